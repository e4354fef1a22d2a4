"""Compile and load the native CPU kernels once per machine (cached by torch in ~/.cache/torch_extensions).

Compiling needs a C++ compiler and ninja; without them, or if the build fails, callers fall back to
the portable torch path and say so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_decode_attention.cpp", "fused_elementwise.cpp", "qkv_rope_cache.cpp", "argmax.cpp", "amx_linear.cpp"
    )
]
_HEADERS = [Path(__file__).with_name("cpu_vec.h")]


def _sources_digest() -> str:
    """Changes whenever a source or header does: torch rebuilds when the build flags change, and does
    not look at headers on its own."""
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def cpu_kernels_available() -> bool:
    """True once torch.ops.crane_mp's kernels (paged_decode_attention, qkv_rope_cache, rms_norm,
    add_rms_norm_, silu_and_mul, argmax_rows, amx_*) are registered."""
    if os.environ.get("CRANE_MP_NO_NATIVE_KERNELS"):
        return False
    try:
        from torch.utils.cpp_extension import load

        load(
            name="crane_mp_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            # -fopenmp makes at::parallel_for parallel; the loader reuses the libgomp torch already loaded.
            extra_cflags=[
                "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math",
                f"-DCRANE_MP_SOURCES_DIGEST={_sources_digest()}",
            ],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, unsupported platform: the torch path still works
        log.warning("native CPU kernels unavailable (%s); using the portable torch attention", err)
        return False
    return hasattr(torch.ops.crane_mp, "paged_decode_attention")
