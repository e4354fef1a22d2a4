"""Rotary position embeddings: cos/sin tables computed once per model, indexed by position each step."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig


def _inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    dim = config.head_dim
    if rope_type in ("dynamic", "ntk_alpha") and params.get("alpha"):
        # Hunyuan's fixed NTK-alpha: stretches the base once, independent of sequence length.
        base = config.rope_theta * params["alpha"] ** (dim / (dim - 2))
        rope_type = "default"
    else:
        base = config.rope_theta
    if rope_type == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        inv_freq = 1.0 / (base**exponents)
        if params.get("freq_factors") is not None:  # GGUF's rope_freqs tensor (Llama 3 scaling, pre-computed)
            inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling depends on the running sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    # Scaled variants (llama3, linear, yarn, longrope) are pure functions of the config: reuse the reference.
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def rope_tables(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
    """Return (cos, signed_sin), each [max_positions, head_dim], rounded to `dtype` as transformers does.

    signed_sin carries rotate-half's minus sign on its first half, so applying rope needs no negation.
    """
    inv_freq, scaling = _inv_freq(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
    sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos, signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/signed_sin: [num_tokens, 1, head_dim].

    Equals x * cos + rotate_half(x) * sin bit for bit: swapping the halves and folding the sign into
    the table only moves an exact negation.
    """
    num_tokens, num_heads, head_dim = x.shape
    swapped = x.reshape(num_tokens, num_heads, 2, head_dim // 2).flip(2).view(num_tokens, num_heads, head_dim)
    return x * cos + swapped * signed_sin
