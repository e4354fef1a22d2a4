"""Rope tables against transformers' rotary embeddings: partial and interleaved rope, the sliding
layers' own base, and Phi-3's LongRoPE (short factors within the original context, long ones past it)."""

from __future__ import annotations

import torch
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from crane_mp.models.config import model_config_from_hf
from crane_mp.testing.make_zoo import build_zoo_config
from crane_mp.worker.models.rope import apply_rope, rope_tables

CPU = torch.device("cpu")


def test_longrope_takes_the_short_factors_within_the_original_context_and_the_long_ones_past_it():
    hf = build_zoo_config("phi3")
    config = model_config_from_hf(hf)
    original = hf.rope_parameters["original_max_position_embeddings"]
    cos, sin = rope_tables(config, 2 * original, torch.float32, CPU)
    assert cos.shape == (2 * original, config.layout.rotary_dim)
    short, _ = Phi3RotaryEmbedding(hf)(torch.zeros(1, 1, 1), torch.arange(original)[None])
    long, _ = Phi3RotaryEmbedding(hf)(torch.zeros(1, 1, 1), torch.arange(2 * original)[None])
    torch.testing.assert_close(cos[:original], short[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(cos[original:], long[0, original:], atol=1e-6, rtol=0)
    assert not torch.allclose(long[0, :original], short[0])  # the two factor sets differ


def test_interleaved_partial_rope_turns_pairs_of_the_leading_dims_only():
    config = model_config_from_hf(build_zoo_config("glm4"))  # rope on half of each head, in pairs
    rotary = config.layout.rotary_dim
    cos, sin = rope_tables(config, 8, torch.float32, CPU)
    x = torch.randn(8, 3, config.head_dim)
    out = apply_rope(x, cos[:, None], sin[:, None], interleaved=True)
    torch.testing.assert_close(out[..., rotary:], x[..., rotary:], atol=0, rtol=0)
    even, odd = x[..., 0:rotary:2], x[..., 1:rotary:2]
    c, s = cos[:, None, 0::2], sin[:, None, 1::2]  # each pair's angle, and its sine's sign on the odd dim
    torch.testing.assert_close(out[..., 0:rotary:2], even * c - odd * s, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[..., 1:rotary:2], odd * c + even * s, atol=1e-6, rtol=0)
