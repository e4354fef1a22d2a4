"""The CUDA path's fused Triton elementwise kernels (RMSNorm with the residual add, SiLU*mul, q/k norm +
rope + KV-cache write), run on CPU through Triton's interpreter, against the portable torch ops the
model falls back to. Skipped without Triton."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHECK = """
import torch
import torch.nn.functional as F
from crane_mp.worker.kernels import triton_elementwise as ops
from crane_mp.worker.models.rope import apply_rope

gen = torch.Generator().manual_seed(0)
def randn(*shape):
    return torch.randn(*shape, generator=gen)

for dtype in (torch.float32, torch.bfloat16):
    # The interpreter narrows to bf16 by truncation (GPUs round to nearest): one bf16 step apart.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    close = lambda got, want: torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    x, residual, weight = randn(7, 96).to(dtype), randn(7, 96).to(dtype), (1 + randn(96) / 4).to(dtype)
    close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x.float(), (96,), weight.float(), 1e-6))
    summed = (residual.float() + x.float()).to(dtype)
    xs, rs = x.clone(), residual.clone()
    ops.add_rms_norm_(xs, rs, weight, 1e-6)
    close(rs, summed)
    close(xs, F.rms_norm(rs.float(), (96,), weight.float(), 1e-6))  # the residual as stored is normalised

    gate_up = randn(5, 2 * 1100).to(dtype)  # two column blocks, the second partial
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(ops.silu_and_mul(gate_up), F.silu(gate) * up)

    heads, kv_heads, head_dim, tokens = 6, 2, 64, 9
    for position in (0, 1, 2):
        qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
        angles = randn(tokens, head_dim // 2)
        cos = torch.cat([angles.cos()] * 2, -1).to(dtype)[:, None]
        sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)[:, None]
        norm_weight = (1 + randn(heads + kv_heads, head_dim) / 4).to(dtype)
        slots = torch.randperm(4 * 16, generator=gen)[:tokens]
        k_cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = ops.qkv_rope_cache(qkv, cos, sin, norm_weight if position else None, position, 1e-6, slots,
                               k_cache, v_cache, heads)
        qk = qkv.float()[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        norm = lambda t: F.rms_norm(t, (head_dim,), None, 1e-6) * norm_weight.float()
        if position == 1:
            qk = norm(qk)
        qk = apply_rope(qk, cos.float(), sin.float())
        if position == 2:
            qk = norm(qk)
        close(q, qk[:, :heads])
        close(k_cache.view(-1, kv_heads, head_dim)[slots], qk[:, heads:])
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v)
print("checked")
"""


def test_triton_elementwise_kernels_equal_the_torch_ops_in_the_interpreter():
    assert "checked" in run_interpreted(_CHECK)


_DELTA_CHECK = """
import torch
from crane_mp.worker.kernels import triton_elementwise as ops
from crane_mp.worker.models.gated_deltanet import l2_normalize, recurrent_step

gen = torch.Generator().manual_seed(0)
for heads, key_dim, value_dim in ((4, 16, 8), (2, 128, 128), (3, 24, 40)):
    batch, slots = 3, torch.tensor([4, 0, 2])
    q = l2_normalize(torch.randn(batch, heads, key_dim, generator=gen)) * key_dim**-0.5
    k = l2_normalize(torch.randn(batch, heads, key_dim, generator=gen))
    v = torch.randn(batch, heads, value_dim, generator=gen)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    state = torch.randn(6, heads, key_dim, value_dim, generator=gen)
    before = state.clone()
    out = ops.gated_delta_step_(q, k, v, g, beta, state, slots)
    expected, after = recurrent_step(q, k, v, g, beta, before[slots])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[slots], after, atol=1e-5, rtol=1e-5)
    others = [slot for slot in range(6) if slot not in slots.tolist()]
    assert torch.equal(state[others], before[others])
print("ok")
"""


def test_the_gated_delta_step_equals_the_torch_ops_on_its_slots_alone():
    assert run_interpreted(_DELTA_CHECK).strip() == "ok"
