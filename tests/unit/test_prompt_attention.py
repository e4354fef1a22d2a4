"""The AVX512-BF16 prompt attention kernel (kernels/prompt_attention.cpp) against float64 attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crane_mp.worker.kernels.cpu_isa import kernel_isa


def _kernel_available() -> bool:
    return kernel_isa() is not None and bool(torch.ops.crane_mp.prompt_attention_available())


pytestmark = pytest.mark.skipif(not _kernel_available(), reason="the native kernels of this tier lack AVX512-BF16")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int) -> torch.Tensor:
    """float64 attention of q [T, H, D] over k, v [S, KH, D] (bf16-rounded, as the kernel reads them), query t
    seeing keys 0 .. offset + t."""
    T, H, _ = q.shape
    S, KH, _ = k.shape
    rounded = [x.to(torch.bfloat16).double().transpose(0, 1)[None] for x in (q, k, v)]
    keys = torch.arange(S)[None, :]
    mask = keys <= (offset + torch.arange(T))[:, None]
    out = F.scaled_dot_product_attention(*rounded, attn_mask=mask, scale=scale, enable_gqa=H != KH)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("T, S, H, KH, D", [(1, 1, 2, 1, 64), (37, 37, 4, 2, 128), (70, 70, 8, 2, 64),
                                           (130, 130, 2, 2, 128), (45, 200, 4, 1, 128), (64, 64, 4, 4, 256)])
def test_causal_prompts_match_float64_attention(T, S, H, KH, D):
    torch.manual_seed(T * 1000 + S)
    q, k, v = torch.randn(T, H, D), torch.randn(S, KH, D), torch.randn(S, KH, D)
    scale = D**-0.5
    got = torch.ops.crane_mp.prompt_attention_bf16(q, k, v, scale, S - T)
    expected = _reference(q, k, v, scale, S - T)
    assert got.dtype == torch.float32 and got.shape == (T, H, D)
    error = (got.double() - expected).abs()
    # The softmax weights go to the values as bf16: a relative error of 2^-9 each.
    assert error.max().item() < 2e-2 and error.mean().item() < 2e-3


def test_a_query_sees_no_key_past_its_position():
    torch.manual_seed(1)
    T, H, D = 100, 4, 128
    q, k, v = torch.randn(T, H, D), torch.randn(T, 2, D), torch.randn(T, 2, D)
    base = torch.ops.crane_mp.prompt_attention_bf16(q, k, v, 0.1, 0)
    k2, v2 = k.clone(), v.clone()
    k2[60:], v2[60:] = torch.randn(40, 2, D) * 5, torch.randn(40, 2, D) * 5
    changed = torch.ops.crane_mp.prompt_attention_bf16(q, k2, v2, 0.1, 0)
    assert torch.equal(base[:60], changed[:60])
    assert not torch.equal(base[60:], changed[60:])


def test_bfloat16_inputs_give_bfloat16_rows_of_the_same_values():
    torch.manual_seed(2)
    q, k, v = (torch.randn(50, 4, 64).bfloat16() for _ in range(3))
    got = torch.ops.crane_mp.prompt_attention_bf16(q, k[:, :2], v[:, :2], 0.125, 0)
    assert got.dtype == torch.bfloat16
    as_float = torch.ops.crane_mp.prompt_attention_bf16(q.float(), k[:, :2].float(), v[:, :2].float(), 0.125, 0)
    assert torch.equal(got, as_float.bfloat16())


@pytest.mark.parametrize("q_shape, kv_shape, offset, message", [
    ((10, 4, 96), (10, 2, 96), 0, "multiple of 64"),
    ((10, 3, 64), (10, 2, 64), 0, "query heads"),
    ((10, 4, 64), (12, 2, 64), 3, "over 12 keys"),
])
def test_shapes_it_cannot_take_are_refused(q_shape, kv_shape, offset, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.crane_mp.prompt_attention_bf16(torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape),
                                                 1.0, offset)
