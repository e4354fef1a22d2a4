"""Device, compute dtype and KV-cache dtype choice.

On CUDA, 16-bit weights are kept and float32 checkpoints run in bf16. On CPU the choice follows the
instruction-set tier (kernels/cpu_isa.py): from measurement on a 2-core Sapphire Rapids host
(benchmarks/RESULTS.md), bf16 GEMMs on AMX run ~5x faster than float32 at 32 rows and about the same
per token at 1 row, while emulated bf16 is several times slower than float32.
"""

from __future__ import annotations

import os

import torch

from crane_mp.worker.kernels.cpu_isa import cpu_dtype, native_bf16

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prefer_huge_pages() -> None:
    """Large CPU tensors (weights repacked at load, the KV cache) in 2 MiB pages: every decode step
    streams them, and the hardware prefetchers stop at each 4 KiB page boundary (repacked Q4_K rows
    streamed 19% faster at one row, same process). torch's allocator reads this variable at its first
    large allocation; an operator's own setting (0 turns it off) wins. Weights read from a GGUF file
    are numpy arrays, which numpy already places in huge pages."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def select_device(force_cpu: bool) -> torch.device:
    if not force_cpu and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def select_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    ckpt = _NAMES.get(checkpoint_dtype or "", torch.float32)
    wanted = None if requested == "auto" else _NAMES[requested]
    if device.type == "cpu":
        return cpu_dtype(wanted, ckpt)
    if wanted is not None:
        return wanted
    if ckpt == torch.float32:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return ckpt


def select_kv_dtype(requested: str, compute: torch.dtype, device: torch.device, embedding: bool = False) -> torch.dtype:
    """--kv-cache-dtype. auto on CPU is 16-bit whatever the compute dtype (bf16 where bf16 math is native,
    else float16, which F16C converts in one instruction): half the bytes of a float32 cache, so the
    same memory limit holds twice the context, and decode attention reads half the bytes. An embedding
    model only reads its cache within one prompt: auto keeps the compute dtype there, so embeddings equal
    the reference's at its precision. The CUDA kernels read the cache in the compute dtype, so there
    auto is that and nothing else is accepted."""
    if device.type == "cpu":
        if requested == "auto" and embedding:
            return compute
        if requested == "auto":
            return torch.bfloat16 if native_bf16() else torch.float16
        return _NAMES[requested]
    if requested not in ("auto", str(compute).removeprefix("torch.")):
        raise ValueError(f"--kv-cache-dtype {requested}: on CUDA the KV cache is kept in the compute dtype "
                         f"({str(compute).removeprefix('torch.')}); use auto")
    return compute


def device_label(device: torch.device) -> str:
    """crane-oai's spelling, reported by /model_info: Cuda(0) or Cpu."""
    return f"Cuda({device.index or 0})" if device.type == "cuda" else "Cpu"


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


def is_device_fault(err: BaseException) -> bool:
    """Errors after which the device's state is unknown: the server stops rather than go on. Not an
    out-of-memory error, nor a kernel that fails to compile or launch: those leave the device usable."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    text = str(err)
    return "CUDA error" in text or any(phrase in text for phrase in _STICKY_CUDA_ERRORS)
