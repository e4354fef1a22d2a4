"""Process-wide device facts that need no platform: huge pages for large host tensors, the GPU's
multiprocessor count (sizes the Triton kernels' grids) and which errors leave a device unusable.
What runs where is the platform's (platforms/)."""

from __future__ import annotations

import os

import torch


def prefer_huge_pages() -> None:
    """Large CPU tensors (weights repacked at load, the KV cache) in 2 MiB pages: every decode step
    streams them, and the hardware prefetchers stop at each 4 KiB page boundary (repacked Q4_K rows
    streamed 19% faster at one row, same process). torch's allocator reads this variable at its first
    large allocation; an operator's own setting (0 turns it off) wins. Weights read from a GGUF file
    are numpy arrays, which numpy already places in huge pages."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors, which size the split kernels' grids. Off CUDA (Triton's interpreter in
    tests) 4, as on a small GPU, so that the split paths run there."""
    if device.type != "cuda":
        return 4
    index = device.index or 0
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# Launch errors after which a CUDA context is unusable, as Triton words them ("Triton Error [CUDA]: ...");
# torch's own say "CUDA error: ...".
_STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "unspecified launch failure",
                       "illegal instruction", "device-side assert", "hardware stack error")


class RankLost(RuntimeError):
    """A collective between tensor-parallel ranks failed: a rank died or its link broke. No request's
    fault, and no step can run without every rank."""


def is_device_fault(err: BaseException) -> bool:
    """Errors after which the device's state is unknown: the server stops rather than go on. Not an
    out-of-memory error, nor a kernel that fails to compile or launch: those leave the device usable."""
    if isinstance(err, RankLost):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    text = str(err)
    return "CUDA error" in text or any(phrase in text for phrase in _STICKY_CUDA_ERRORS)
