"""Device and dtype choice.

CPU default dtype, from measurement on a 2-core Sapphire Rapids host (benchmarks/RESULTS.md): bf16 GEMMs
on AMX run ~5x faster than fp32 at 32 rows and about the same per token at 1 row, so checkpoints stay in
bf16 where the CPU has native bf16 (AMX or AVX512-BF16) and are upcast to float32 elsewhere, where bf16
is emulated and slow. On CUDA, 16-bit weights are kept and float32 checkpoints run in bf16.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_device(force_cpu: bool) -> torch.device:
    if not force_cpu and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def select_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _NAMES[requested]
    ckpt = _NAMES.get(checkpoint_dtype or "", torch.float32)
    if device.type == "cuda":
        if ckpt == torch.float32:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return ckpt
    if ckpt == torch.float32 or not cpu_has_native_bf16():
        return torch.float32
    return torch.bfloat16


def device_label(device: torch.device) -> str:
    """crane-oai's spelling, reported by /model_info: Cuda(0) or Cpu."""
    return f"Cuda({device.index or 0})" if device.type == "cuda" else "Cpu"
