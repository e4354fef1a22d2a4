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

from tests.triton_compile import (  # noqa: E402
    SHARED_MEMORY_LIMIT,
    compile_launch,
    nvidia_backend_available,
    recorded_launches,
)

if not nvidia_backend_available():
    pytest.skip("Triton's NVIDIA backend (ptxas, cuobjdump) is not installed", allow_module_level=True)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (query heads, KV heads, head dim): Llama-3/Qwen3-8B, the benchmark model, Qwen2.5-7B (group 7), MHA.
ATTENTION_SHAPES = ((32, 8, 128), (8, 2, 64), (28, 4, 128), (16, 16, 64))


def _attention_launches() -> None:
    from crane_mp.worker.kernels import triton_attention as kernels

    for dtype in (torch.bfloat16, torch.float32):  # float16 compiles as bfloat16 does
        for heads, kv_heads, head_dim in ATTENTION_SHAPES:
            cache = torch.empty(8, 16, kv_heads, head_dim, dtype=dtype)
            tables = torch.zeros(4, 8, dtype=torch.int32)
            lengths = torch.zeros(4, dtype=torch.int32)
            q = torch.empty(4, heads, head_dim, dtype=dtype)
            for splits in (1, 16):
                workspace = kernels.decode_workspace(4, heads, head_dim, splits, "cpu")
                kernels.paged_decode(q, cache, cache, tables, lengths, torch.empty_like(q), 0.1, 0, splits, workspace)
            chunk = torch.empty(100, heads, head_dim, dtype=dtype)
            kernels.paged_prefill(chunk, cache, cache, tables, lengths, lengths, lengths, 100, torch.empty_like(chunk),
                                  0.1, 4096)


def _elementwise_launches() -> None:
    from crane_mp.worker.kernels import triton_elementwise as kernels

    for dtype in DTYPES:
        for hidden in (512, 4096, 8192):
            x = torch.empty(3, hidden, dtype=dtype)
            kernels.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6)
            kernels.add_rms_norm_(x, torch.empty_like(x), torch.empty(hidden, dtype=dtype), 1e-6)
        kernels.silu_and_mul(torch.empty(3, 2 * 14336, dtype=dtype))
        for heads, kv_heads, head_dim in ATTENTION_SHAPES:
            cache = torch.empty(8, 16, kv_heads, head_dim, dtype=dtype)
            qkv = torch.empty(5, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
            rope = torch.empty(5, head_dim, dtype=dtype)
            for norm_position in (0, 1, 2):
                kernels.qkv_rope_cache(qkv, rope, rope, torch.empty(heads + kv_heads, head_dim, dtype=dtype),
                                       norm_position, 1e-6, torch.zeros(5, dtype=torch.int64), cache, cache, heads)


def _gguf_launches() -> None:
    from crane_mp.worker.quantized import triton_dequant as kernels
    from crane_mp.worker.quantized.formats import LAYOUTS

    for dtype in DTYPES:
        for qtype in sorted(kernels.TRITON_TYPES):
            layout = LAYOUTS[qtype]
            weight = torch.empty(64, 4096 // layout.block * layout.bytes, dtype=torch.uint8)
            kernels.triton_dequantize(weight, qtype, 4096, dtype)
            kernels.triton_quantized_matmul(torch.empty(8, 4096, dtype=dtype), weight, qtype, 4096)


FAMILIES = {"attention": _attention_launches, "elementwise": _elementwise_launches, "gguf": _gguf_launches}


@pytest.mark.parametrize("capability", [86, 90])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernels_compile_within_the_sm_budget(family, capability):
    with recorded_launches() as launches:
        FAMILIES[family]()
    assert launches, "the wrappers launched nothing"
    problems = []
    for launch in launches:
        built = compile_launch(launch, capability)
        constants = {k: v for k, v in launch.kwargs.items() if k.isupper()}
        dtypes = sorted({str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor)})
        where = f"{launch.name} {dtypes} {constants}"
        if built.shared_bytes > SHARED_MEMORY_LIMIT[capability]:
            problems.append(f"{where}: {built.shared_bytes} bytes of shared memory")
        if capability == 90 and built.stack_bytes:
            problems.append(f"{where}: spills ({built.registers} registers, {built.stack_bytes} stack bytes)")
    assert not problems, "\n".join(problems)
