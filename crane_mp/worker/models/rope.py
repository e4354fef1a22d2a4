"""Rotary position embeddings: cos/sin tables computed once per model, indexed by position each step."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig


def _inv_freq(config: ModelConfig, params: dict, theta: float, head_dim: int,
              seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    dim = config.layout.rotary_dim or head_dim
    if rope_type in ("dynamic", "ntk_alpha") and params.get("alpha"):
        # Hunyuan's fixed NTK-alpha: stretches the base once, independent of sequence length.
        base = theta * params["alpha"] ** (dim / (dim - 2))
        rope_type = "default"
    else:
        base = theta
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
    layer_type = {"layer_type": params["layer_type"]} if "layer_type" in params else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, torch.device("cpu"),
                                                                 seq_len=seq_len, **layer_type)
    return inv_freq.float(), float(attention_scaling)


def rope_tables(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                sliding: bool = False):
    """Return (cos, signed_sin), each [max_positions, rotary dims], rounded to `dtype` as transformers
    does; `sliding`: the sliding layers' own table (DecoderLayout.sliding_rope).

    signed_sin carries the rotation's minus sign (on the first half, or on the even dims when rope
    turns interleaved pairs), so applying rope needs no negation.
    """
    params = config.layout.sliding_rope if sliding else config.rope_parameters
    theta = float(params.get("rope_theta", config.rope_theta)) if sliding else config.rope_theta
    # The global layers' head size where it is their own (Gemma 4); the variants transformers computes
    # read it from the config's per-layer view themselves.
    head_dim = config.head_dim if sliding else config.layout.global_head_dim or config.head_dim
    inv_freq, scaling = _inv_freq(config, params, theta, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary dims / 2]
    if params.get("rope_type") == "longrope":
        # Phi-3's LongRoPE: the short factors up to the original context, the long ones past it, per
        # position (vLLM's reading; transformers switches a whole batch once its longest sequence is past).
        original = int(params["original_max_position_embeddings"])
        long_inv_freq, _ = _inv_freq(config, params, theta, head_dim, seq_len=original + 1)
        freqs[original:] = positions[original:, None] * long_inv_freq[None, :]
    if config.layout.rope_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
        sign = torch.tensor([-1.0, 1.0]).repeat(freqs.shape[-1])
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones(freqs.shape[-1]), torch.ones(freqs.shape[-1])))
    cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
    sin = (emb.sin() * scaling).to(dtype=dtype)
    return cos, (sin * sign.to(dtype)).to(device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/signed_sin: [num_tokens, 1, rotary dims]. Rope turns the
    leading rotary dims (all of them but for partial rotary) and passes the rest through.

    Equals x * cos + rotate_half(x) * sin bit for bit: swapping the halves (or each pair's two values)
    and folding the sign into the table only moves an exact negation.
    """
    num_tokens, num_heads, head_dim = x.shape
    rotary = cos.shape[-1]
    turned = x if rotary == head_dim else x[..., :rotary]
    if interleaved:
        swapped = turned.reshape(num_tokens, num_heads, rotary // 2, 2).flip(3).view(num_tokens, num_heads, rotary)
    else:
        swapped = turned.reshape(num_tokens, num_heads, 2, rotary // 2).flip(2).view(num_tokens, num_heads, rotary)
    out = turned * cos + swapped * signed_sin
    return out if rotary == head_dim else torch.cat([out, x[..., rotary:]], dim=-1)
