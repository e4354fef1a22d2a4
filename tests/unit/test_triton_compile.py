"""Every Triton kernel of the CUDA path, launched by its Python wrapper for the shapes we serve, compiles
to a cubin for Ampere (sm86: the tightest shared memory) and Hopper (sm90), fits the SM's shared memory,
and on Hopper keeps every value in registers (no spills to local memory, which would make the
bandwidth-bound decode kernels slow). No GPU needed: Triton's compiler and ptxas do the work. What the
kernels compute is checked by the interpreter tests (test_triton_*.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted functions under TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from crane_mp.testing.triton_compile import (  # noqa: E402
    SHARED_MEMORY_LIMIT,
    attention_launches,
    compile_launch,
    compile_launches,
    elementwise_launches,
    experts_launches,
    gguf_launches,
    nvidia_backend_available,
    recorded_launches,
    skinny_launches,
)

if not nvidia_backend_available():
    pytest.skip("Triton's NVIDIA backend (ptxas, cuobjdump) is not installed, or this Triton release binds "
                "kernel arguments differently (crane_mp/testing/triton_compile.py)", allow_module_level=True)

DTYPES = (torch.bfloat16, torch.float32)  # float16 compiles as bfloat16 does
# (query heads, KV heads, head dim): Llama-3/Qwen3-8B, the benchmark model, Qwen2.5-7B (group 7), MHA.
ATTENTION_SHAPES = ((32, 8, 128), (8, 2, 64), (28, 4, 128), (16, 16, 64))


def _attention_launches() -> None:
    for dtype in DTYPES:
        for shape in ATTENTION_SHAPES:
            attention_launches(dtype, *shape)


def _elementwise_launches() -> None:
    for dtype in DTYPES:
        for hidden, shape in zip((4096, 512, 3584, 8192), ATTENTION_SHAPES):
            elementwise_launches(dtype, hidden, 14336, *shape)


def _gguf_launches() -> None:
    for dtype in DTYPES:
        gguf_launches(dtype)


def _experts_launches() -> None:
    for dtype in DTYPES:
        experts_launches(dtype)


def _skinny_launches() -> None:
    for dtype in (torch.bfloat16, torch.float16):  # float32 weights keep cuBLAS
        skinny_launches(dtype)


FAMILIES = {"attention": _attention_launches, "elementwise": _elementwise_launches, "experts": _experts_launches,
            "gguf": _gguf_launches, "skinny": _skinny_launches}


@pytest.mark.parametrize("capability", [86, 90])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernels_compile_within_the_sm_budget(family, capability):
    with recorded_launches() as launches:
        FAMILIES[family]()
    assert launches, "the wrappers launched nothing"
    problems = []
    for launch, built in zip(launches, compile_launches(launches, capability)):
        constants = {k: v for k, v in launch.kwargs.items() if k.isupper()}
        dtypes = sorted({str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor)})
        where = f"{launch.name} {dtypes} {constants}"
        if built.shared_bytes > SHARED_MEMORY_LIMIT[capability]:
            problems.append(f"{where}: {built.shared_bytes} bytes of shared memory")
        if capability == 90 and built.stack_bytes:
            problems.append(f"{where}: spills ({built.registers} registers, {built.stack_bytes} stack bytes)")
    assert not problems, "\n".join(problems)


def test_fused_gguf_matmul_fits_the_programs_per_sm_its_grid_is_sized_for():
    """k_splits sizes the decode matmul's grid for _PROGRAMS_PER_SM programs an SM; for the formats of
    Q8_0 and Q4_K_M files the registers must allow that many (65,536 an SM on sm90). A tile whose start
    the compiler cannot prove aligned to BLOCK_K loads scales per element and needs ~3x the registers."""
    from gguf import GGMLQuantizationType as T

    from crane_mp.worker.quantized.triton_dequant import _PROGRAMS_PER_SM

    with recorded_launches() as launches:
        gguf_launches(torch.bfloat16)
    matmuls = [launch for launch in launches
               if launch.name == "_block_matmul_kernel" and launch.kwargs["QTYPE"] in (T.Q8_0, T.Q4_K, T.Q6_K)]
    assert len(matmuls) == 3
    for launch in matmuls:
        built = compile_launch(launch, 90)
        per_program = built.registers * built.num_warps * 32
        assert per_program * _PROGRAMS_PER_SM <= 65536, (T(launch.kwargs["QTYPE"]).name, built)
