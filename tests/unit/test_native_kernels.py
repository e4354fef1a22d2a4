"""The fused native CPU kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crane_mp.worker.kernels.cpu_isa import kernel_isa
from crane_mp.worker.models.rope import apply_rope

pytestmark = pytest.mark.skipif(kernel_isa() is None, reason="native kernels disabled or not built")


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("vocab", [1, 15, 16, 50, 8192 + 7])
def test_argmax_rows_matches_torch_including_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 0.5  # all tied: the first index wins
    x[2, vocab // 2 :] = 100.0  # tie between two lanes / the tail
    x[3] = float("-inf")
    assert torch.ops.crane_mp.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("norm_position", [0, 1, 2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 32), (6, 1, 128)])
def test_qkv_rope_cache_equals_the_unfused_ops(dtype, cache_dtype, norm_position, heads, kv_heads, head_dim):
    """Keys and values land in the cache in its own dtype, rounded once from float."""
    gen = torch.Generator().manual_seed(heads + norm_position)
    tokens, num_blocks, block_size, eps = 5, 4, 4, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    weight = (torch.rand(heads + kv_heads, head_dim, generator=gen) + 0.5).to(dtype)
    slots = torch.tensor([9, 0, 15, 4, 3])
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)

    q = torch.ops.crane_mp.qkv_rope_cache(
        qkv, cos, sin, weight if norm_position else None, norm_position, eps, slots, k_cache, v_cache, heads
    )

    qk = qkv[:, : (heads + kv_heads) * head_dim].float().view(tokens, heads + kv_heads, head_dim)

    def norm(x):
        return F.rms_norm(x, (head_dim,), None, eps) * weight.float()

    if norm_position == 1:
        qk = norm(qk)
    qk = apply_rope(qk, cos.float(), sin.float())
    if norm_position == 2:
        qk = norm(qk)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    assert q.dtype == dtype and k_cache.dtype == cache_dtype
    torch.testing.assert_close(q.float(), qk[:, :heads], **tolerance(dtype))
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots].float(), qk[:, heads:], **tolerance(cache_dtype))
    assert torch.equal(flat_v[slots], v.to(cache_dtype))  # one rounding, to nearest even
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 64), (37, 512), (3, 100)])
def test_add_rms_norm_updates_both_in_place(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = torch.rand(dim, generator=gen).to(dtype)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual.float(), (dim,), weight.float(), 1e-5)
    torch.ops.crane_mp.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (33, 700)])
def test_silu_and_mul(dtype, rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    gate, up = gate_up.float().split(inter, dim=-1)
    torch.testing.assert_close(
        torch.ops.crane_mp.silu_and_mul(gate_up).float(), F.silu(gate) * up, **tolerance(dtype)
    )


def test_qkv_rope_cache_rejects_a_slot_outside_the_cache():
    cache = torch.zeros(2, 4, 1, 8)
    qkv = torch.zeros(1, 3 * 8)
    rope = torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.crane_mp.qkv_rope_cache(qkv, rope, rope, None, 0, 1e-6, torch.tensor([8]), cache, cache.clone(), 1)


def test_bf16_rounding_matches_torch_on_ties_and_specials():
    # residual + x lands exactly halfway between two bf16 values (ties go to even), or is special; 67
    # values cover the vector body and the scalar tail. A NaN with a full payload (0x7fff) must stay
    # NaN: rounding its bits as a number would carry into the sign and give -0.
    halfway = [2.0**-8, 3 * 2.0**-8, -(2.0**-8), 5 * 2.0**-8, 1e30, float("inf"), float("-inf"), float("nan")]
    x = torch.tensor((halfway * 9)[:67], dtype=torch.float32).to(torch.bfloat16)
    x.view(torch.int16)[[5, 66]] = 0x7FFF
    residual = torch.ones(1, 67, dtype=torch.bfloat16)
    expected = (residual.float() + x.float()).to(torch.bfloat16)
    torch.ops.crane_mp.add_rms_norm_(x.view(1, 67).clone(), residual, torch.ones(67, dtype=torch.bfloat16), 1e-5)
    nan = expected.isnan()
    assert nan.sum() == 10 and torch.equal(residual.isnan(), nan)
    assert torch.equal(residual[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "key_dim", "value_dim"), [(4, 16, 8), (2, 128, 128), (3, 24, 40)])
def test_the_gated_delta_step_equals_the_torch_ops_on_its_slots_alone(state_dtype, heads, key_dim, value_dim):
    from crane_mp.worker.models.gated_deltanet import l2_normalize, recurrent_step

    gen = torch.Generator().manual_seed(heads + key_dim)
    batch, slots = 3, torch.tensor([4, 0, 2])
    q = l2_normalize(torch.randn(batch, heads, key_dim, generator=gen)) * key_dim**-0.5
    k = l2_normalize(torch.randn(batch, heads, key_dim, generator=gen))
    v = torch.randn(batch, heads, value_dim, generator=gen)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    state = torch.randn(6, heads, key_dim, value_dim, generator=gen).to(state_dtype)
    before = state.clone()
    out = torch.ops.crane_mp.gated_delta_step_(q, k, v, g, beta, state, slots)
    expected, after = recurrent_step(q, k, v, g, beta, before[slots].float())
    torch.testing.assert_close(out, expected, **tolerance(state_dtype))
    torch.testing.assert_close(state[slots].float(), after.to(state_dtype).float(), **tolerance(state_dtype))
    untouched = [slot for slot in range(6) if slot not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])
