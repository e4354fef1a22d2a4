"""The device a worker runs on and every choice that follows from it, made once.

`select_platform` (the worker's bootstrap) is where a device is chosen; `platform_for` gives the same
object for a torch.device (tests, benchmarks). The Platform is handed to what the worker builds
(loaders, layers, runner, sampler, grammar engine), which call it instead of testing the device:
vLLM's platforms and dispatch-once custom ops are the model.
"""

from __future__ import annotations

import functools

import torch

from crane_mp.worker.platforms.base import Platform
from crane_mp.worker.platforms.cpu import CpuPlatform
from crane_mp.worker.platforms.cuda import CudaPlatform


def on_cuda(force_cpu: bool) -> bool:
    """The worker runs on CUDA: there is a device and --cpu was not asked for."""
    return not force_cpu and torch.cuda.is_available()


def select_platform(force_cpu: bool, cuda_index: int = 0) -> Platform:
    """CUDA device `cuda_index` (a tensor-parallel rank's on its host) where on_cuda, else the CPU."""
    if on_cuda(force_cpu):
        return platform_for(torch.device("cuda", cuda_index))
    return platform_for(torch.device("cpu"))


def platform_for(device: torch.device | str) -> Platform:
    device = torch.device(device)
    return _platform(device.type, device.index or 0)


@functools.cache
def _platform(kind: str, index: int) -> Platform:
    if kind == "cpu":
        return CpuPlatform()
    if kind == "cuda":
        return CudaPlatform(index)
    raise ValueError(f"no platform for device type {kind!r}")
