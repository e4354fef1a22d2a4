"""Small per-step inputs (ids, positions, sampling parameters) moved to the device without a wait.

On CUDA the values are written to page-locked host memory (torch's caching host allocator keeps those
buffers and reuses one only after the copy that read it has finished) and copied asynchronously, so
building a step never blocks on the GPU. On CPU the tensor is simply made where it is used.
"""

from __future__ import annotations

import numpy as np
import torch


def device_tensor(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(values, dtype=dtype)  # an array of that dtype is not copied
    if host.device == device:  # used on the host: nothing to copy
        return host
    # torch.tensor(ndarray, pin_memory=True) refuses numpy input, so pin a copy of the host tensor; the
    # copy also frees the caller to reuse its array while the transfer is in flight.
    return host.pin_memory().to(device, non_blocking=True)


def device_longs(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.long, device)


def device_floats(values: list, device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.float32, device)


def device_bools(values: list[bool], device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.bool, device)
