"""Which CPU instructions crane-mp may use, and the choices that follow from it: the CPU dtype, oneDNN's
bf16 weight packing, our AMX bf16 GEMM, and the tier our native kernels run at (platforms/cpu.py hands
them out, or the portable torch ops). Whether GGUF prompts take the AMX-INT8 tiles: tile_check.py.

Tiers (config.CPU_ISAS), each containing the one before:

    avx2         AVX2, FMA, F16C                      Haswell and later, every Zen
    avx512       + AVX-512 F/BW/VL/DQ                 Skylake-SP, Cascade Lake, Ice Lake
    avx512_bf16  + AVX512-BF16 (native bf16 math)     Cooper Lake, Zen 4/5, Sapphire Rapids
                 and AVX512-VNNI (byte dot products)
    amx          + AMX-BF16 and AMX-INT8 tiles        Sapphire Rapids and later
                 the OS grants us

The host's tier comes from CPUID (torch's cpuinfo: right under an emulator too, unlike
/proc/cpuinfo); CRANE_MP_ISA caps it. Below avx2, with CRANE_MP_NO_NATIVE_KERNELS, or when the
kernels cannot be built, the portable torch ops run.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from crane_mp.config import CPU_ISAS, cpu_isa_cap, native_kernels_disabled
from crane_mp.worker.kernels.loader import build_kernels, compiler_identity

log = logging.getLogger(__name__)


def _at_least(isa: str | None, tier: str) -> bool:
    return isa is not None and CPU_ISAS.index(isa) >= CPU_ISAS.index(tier)


@lru_cache(maxsize=1)
def host_isa() -> str | None:
    """The highest tier this CPU (and OS, for AMX's tile state) supports; None below AVX2."""
    cpu = torch.cpu
    if not cpu._is_avx2_supported():
        return None
    if not cpu._is_avx512_supported():  # torch's check: AVX-512 F, BW, VL and DQ together
        return "avx2"
    if not cpu._is_avx512_bf16_supported() or not cpu._is_vnni_supported():  # the tier's kernels use both
        return "avx512"
    if cpu._is_amx_tile_supported() and cpu._init_amx():  # _init_amx asks Linux for the tile state
        return "amx"
    return "avx512_bf16"


@lru_cache(maxsize=1)
def cpu_isa() -> str | None:
    """The host's tier capped by CRANE_MP_ISA: what torch's own CPU code is steered by (dtype, packing)."""
    host, cap = host_isa(), cpu_isa_cap()
    if host is None or cap is None:
        return host
    return CPU_ISAS[min(CPU_ISAS.index(host), CPU_ISAS.index(cap))]


@lru_cache(maxsize=1)
def kernel_isa() -> str | None:
    """The tier our native kernels were built for and loaded at (built on first call); None when the
    portable torch ops run instead. A tier the compiler cannot build falls back to the next one down."""
    isa = cpu_isa()
    if isa is None or native_kernels_disabled():
        return None
    if compiler_identity() is None:
        log.warning("no C++ compiler found (set CXX); using the portable torch ops")
        return None
    for tier in reversed(CPU_ISAS[: CPU_ISAS.index(isa) + 1]):
        if build_kernels(tier):
            return tier
    log.warning("no native CPU kernels could be built; using the portable torch ops")
    return None


@lru_cache(maxsize=1)
def amx_gemm() -> bool:
    """Our AMX bf16 GEMM (kernels/amx_linear.cpp) is built and allowed to run."""
    return kernel_isa() == "amx" and bool(torch.ops.crane_mp.amx_available())


@lru_cache(maxsize=1)
def bf16_linear() -> bool:
    """Our AVX512-BF16 linear kernels (kernels/bf16_linear.cpp) are built and allowed to run."""
    return _at_least(kernel_isa(), "avx512_bf16") and bool(torch.ops.crane_mp.bf16_linear_available())


@lru_cache(maxsize=1)
def prompt_attention_kernel() -> bool:
    """Our AVX512-BF16 attention (kernels/prompt_attention.cpp) takes long prompts: on CPUs with AVX512-BF16
    and no AMX tiles (with tiles, torch's bf16 attention runs on them, and faster)."""
    return kernel_isa() == "avx512_bf16" and bool(torch.ops.crane_mp.prompt_attention_available())


@lru_cache(maxsize=1)
def widened_linear() -> bool:
    """Our float32 linear kernel over bf16 weights (kernels/widened_linear.cpp) runs here: the tiers
    without bf16 math, where a bf16 checkpoint computes in float32."""
    return kernel_isa() in ("avx2", "avx512")


def native_bf16() -> bool:
    """bf16 math runs at full speed (AVX512-BF16 or AMX), so bf16 weights beat float32 ones."""
    return _at_least(cpu_isa(), "avx512_bf16")


def pack_bf16_weights(dtype: torch.dtype) -> bool:
    """Pack bf16 linear weights at load (cpu_packing.py): for our AMX GEMM or else oneDNN, whose bf16
    reorder needs AVX-512 BW/VL/DQ (it raises on an AVX2-only CPU); in a float32 model on a CPU without
    bf16 math, the weights a bf16 checkpoint gave, for our widened kernel."""
    if dtype == torch.float32:
        return widened_linear()
    return dtype == torch.bfloat16 and _at_least(cpu_isa(), "avx512") and torch.backends.mkldnn.is_available()


def cpu_dtype(requested: torch.dtype | None, checkpoint: torch.dtype) -> torch.dtype:
    """`--dtype` on CPU (None: auto). auto keeps a 16-bit checkpoint in bf16 only where bf16 math is
    native, and runs float32 elsewhere (emulated bf16 is several times slower). An explicit 16-bit
    dtype is honoured on any CPU: served correctly through slower ops, and the log says so once."""
    if requested is None:
        return torch.bfloat16 if checkpoint != torch.float32 and native_bf16() else torch.float32
    if requested == torch.bfloat16 and not native_bf16() or requested == torch.float16:
        name = str(requested).removeprefix("torch.")
        log.warning("--dtype %s on this CPU (isa=%s) runs through slower emulated ops; --dtype float32 is "
                    "faster here", name, cpu_isa() or "below_avx2")
    return requested
