"""What a GGUF file of a 2026 family says beyond the Llama hyper-parameters, as the transformers
config fields its DecoderLayout reader (layouts.py) reads: llama.cpp's metadata keys and, where its
converter writes none, the defaults llama.cpp itself assumes.
"""

from __future__ import annotations

from typing import Any

from crane_mp.models.layouts import FULL, LINEAR, SLIDING

# llama.cpp's sliding-window pattern where a file has no attention.sliding_window_pattern: every
# n-th layer global (llama_hparams::set_swa_pattern).
_SWA_PATTERN = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gpt-oss": 2}
_DEFAULT_WINDOW = {"gemma2": 4096}  # Gemma 2's files may not say; every Gemma 2 slides
_NO_ROPE_STEP = {"smollm3": 4}  # every 4th layer without rope (llama.cpp's n_no_rope_layer_step)
# The 27B Gemmas scale queries by hidden / heads, not head_dim; llama.cpp knows them by layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Files whose rope_freqs tensor marks the global layers' unrotated dims (factor 1e30: proportional
# rope), rather than holding Llama 3's per-frequency divisors.
PROPORTIONAL_ROPE = frozenset({"gemma4"})


def family_fields(gguf_arch: str, shape, meta: dict[str, Any], tensors: dict,
                  rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """transformers config fields for a file of `gguf_arch` with GGUFShape `shape`; `rope_factors`: its
    rope factor tensors' values by name (Phi-3's LongRoPE)."""
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{name}", default)

    fields: dict[str, Any] = {}
    window = key("attention.sliding_window", _DEFAULT_WINDOW.get(gguf_arch))
    if window:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            sliding = [bool(flag) for flag in pattern]
        else:
            every = int(pattern or _SWA_PATTERN.get(gguf_arch, 0))
            sliding = [every == 0 or i % every < every - 1 for i in range(shape.layers)]
        fields |= {"sliding_window": int(window), "layer_types": [SLIDING if s else FULL for s in sliding]}
        local_base = key("rope.freq_base_swa")
        if local_base is not None and float(local_base) != shape.rope_base:
            full = {"rope_type": "default", "rope_theta": shape.rope_base, **shape.rope_scaling}
            fields["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": float(local_base)}}
    if gguf_arch in ("gemma2", "gemma3"):
        is_27b = shape.layers == _GEMMA_27B_LAYERS[gguf_arch]
        fields["query_pre_attn_scalar"] = shape.hidden // shape.heads if is_27b else shape.head_dim
        fields["final_logit_softcapping"] = key("final_logit_softcapping")
        fields["attn_logit_softcapping"] = key("attn_logit_softcapping")
    if shape.experts:
        fields |= expert_fields(gguf_arch, shape, key)
    if gguf_arch in ("granite", "granitehybrid", "granitemoe"):
        fields |= {"attention_multiplier": float(key("attention.scale", shape.head_dim**-0.5)),
                   "embedding_multiplier": float(key("embedding_scale", 1.0)),
                   "residual_multiplier": float(key("residual_scale", 1.0)),
                   "logits_scaling": float(key("logit_scale", 1.0))}
    if gguf_arch == "granitehybrid":  # Granite 4 dense: every layer attention, its one MLP the shared one
        # The file cannot say position_embedding_type: Granite 4 dense checkpoints turn rope.
        fields |= {"layer_types": ["attention"] * shape.layers, "num_local_experts": 0,
                   "shared_intermediate_size": int(key("expert_shared_feed_forward_length", shape.ffn)),
                   "position_embedding_type": "rope"}
    if gguf_arch in _NO_ROPE_STEP:
        step = _NO_ROPE_STEP[gguf_arch]
        fields["no_rope_layers"] = [int((i + 1) % step != 0) for i in range(shape.layers)]
    if gguf_arch == "glm4":  # rope on the leading part of each head, in pairs (llama.cpp's "normal" rope)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": shape.rope_base,
                                     "partial_rotary_factor": (shape.rope_dims or shape.head_dim) / shape.head_dim}
    if gguf_arch == "cohere2":
        fields["logit_scale"] = float(key("logit_scale", 1.0))
    if gguf_arch == "phi3":
        rope = {"rope_type": "default", "rope_theta": shape.rope_base,
                "partial_rotary_factor": (shape.rope_dims or shape.head_dim) / shape.head_dim}
        if "rope_factors_long.weight" in rope_factors:
            original = int(key("rope.scaling.original_context_length"))
            rope |= {"rope_type": "longrope", "long_factor": rope_factors["rope_factors_long.weight"],
                     "short_factor": rope_factors["rope_factors_short.weight"],
                     "original_max_position_embeddings": original}
            fields["original_max_position_embeddings"] = original
        fields["rope_parameters"] = rope
        fields["sliding_window"] = key("attention.sliding_window") or None  # 0: none (Phi-4)
        fields.pop("layer_types", None)  # Phi-3's window is every layer's
    if gguf_arch == "gemma4":
        fields |= _gemma4_fields(shape, meta, tensors, rope_factors.get("rope_freqs.weight"))
    if gguf_arch == "gpt-oss":
        fields["rope_parameters"] = _yarn(shape, key)
    if gguf_arch == "deepseek2":
        fields |= _deepseek_fields(shape, key)
    if gguf_arch == "glm4moe":  # rope on the leading part of each head, in halves
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": shape.rope_base,
                                     "partial_rotary_factor": (shape.rope_dims or shape.head_dim) / shape.head_dim}
    if gguf_arch == "seed_oss":
        fields["attention_out_bias"] = "blk.0.attn_output.bias" in tensors
    if gguf_arch in _HYBRIDS:
        fields |= _hybrid_fields(gguf_arch, shape, key)
    return fields


_HYBRIDS = frozenset({"qwen35", "qwen35moe", "qwen3next"})


def _hybrid_fields(gguf_arch: str, shape, key) -> dict[str, Any]:
    """Qwen3.5 and Qwen3-Next: every full_attention_interval-th layer attention, the rest Gated
    DeltaNet layers of the ssm.* widths; rope on the leading rope.dimension_count dims of a head.
    llama.cpp's Qwen3.5 files order a layer's value heads tiled over the key heads."""
    interval = int(key("full_attention_interval", 4))
    key_heads, value_heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    return {
        "layer_types": [FULL if (layer + 1) % interval == 0 else LINEAR for layer in range(shape.layers)],
        "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_base,
                            "partial_rotary_factor": (shape.rope_dims or shape.head_dim) / shape.head_dim},
        "gguf_tiled_value_heads": gguf_arch != "qwen3next" and value_heads != key_heads,
    }


def _gemma4_fields(shape, meta: dict[str, Any], tensors: dict, rope_freqs: list[float] | None) -> dict[str, Any]:
    """Gemma 4: head_dim and KV heads are the sliding layers' (the file's key_length is the global
    layers'), proportional rope on the global layers (rope_freqs: 1 on the rotated angles), values =
    keys where a global layer has no attn_v, shared KV, per-layer inputs, double-wide shared MLPs."""
    sliding = shape.sliding or (False,) * shape.layers
    first_global = sliding.index(False) if False in sliding else 0
    first_sliding = sliding.index(True) if True in sliding else first_global
    kv_heads = shape.layer_kv_heads or (shape.kv_heads,) * shape.layers
    shared = int(meta.get("gemma4.attention.shared_kv_layers", 0))
    first_shared = shape.layers - shared
    rotated = sum(1 for factor in rope_freqs if factor < 1e29) if rope_freqs else shape.head_dim // 2
    return {
        "head_dim": shape.head_dim_swa or shape.head_dim, "global_head_dim": shape.head_dim,
        "num_key_value_heads": kv_heads[first_sliding],
        "num_global_key_value_heads": kv_heads[first_global] if kv_heads[first_global] != kv_heads[first_sliding]
        else None,
        "attention_k_eq_v": f"blk.{first_global}.attn_v.weight" not in tensors,
        "rope_parameters": {
            FULL: {"rope_type": "proportional", "rope_theta": shape.rope_base,
                   "partial_rotary_factor": 2 * rotated / shape.head_dim},
            SLIDING: {"rope_type": "default",
                      "rope_theta": float(meta.get("gemma4.rope.freq_base_swa", shape.rope_base))}},
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": shape.per_layer_input,
        "vocab_size_per_layer_input": shape.per_layer_vocab or shape.vocab,
        "use_double_wide_mlp": bool(shape.layer_ffn) and first_shared < shape.layers
        and shape.layer_ffn[first_shared] == 2 * shape.ffn,
        "final_logit_softcapping": meta.get("gemma4.final_logit_softcapping"),
    }


def _deepseek_fields(shape, key) -> dict[str, Any]:
    """DeepSeek-V2/V3: the latent attention's widths, the router (V3's sigmoid, group-limited where the
    file has groups), shared experts after the dense layers; yarn's mscale from llama.cpp's log multiplier
    (0.1 x mscale_all_dim; mscale taken equal, as the released configs have it)."""
    fields: dict[str, Any] = {
        "kv_lora_rank": shape.kv_lora_rank, "q_lora_rank": shape.q_lora_rank or None,
        "qk_rope_head_dim": shape.rope_dims, "qk_nope_head_dim": shape.mla_key_length - shape.rope_dims,
        "v_head_dim": shape.mla_value_length, "head_dim": shape.rope_dims, "num_key_value_heads": shape.heads,
        "moe_intermediate_size": shape.expert_ffn, "n_shared_experts": int(key("expert_shared_count", 0)),
        "first_k_dense_replace": shape.dense_layers, "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "n_group": int(key("expert_group_count", 1)), "topk_group": int(key("expert_group_used_count", 1)),
        "n_routed_experts": shape.experts, "num_experts_per_tok": shape.experts_used,
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "topk_method": "group_limited_greedy" if int(key("expert_group_count", 1)) > 1 else "greedy"}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_base, **shape.rope_scaling}
    if rope["rope_type"] == "yarn":
        mscale = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope |= {"beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                 "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "mscale": mscale or 1.0,
                 "mscale_all_dim": mscale}
    fields["rope_parameters"] = rope
    return fields


def _yarn(shape, key) -> dict[str, Any]:
    """gpt-oss's yarn rope, its correction range not rounded to whole dims (the checkpoints' truncate:
    false); llama.cpp's converter writes the betas."""
    return {"rope_type": "yarn", "rope_theta": shape.rope_base, **shape.rope_scaling,
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}


# Whether the top k routing weights are rescaled to sum to 1, as llama.cpp computes each architecture
# (its converter writes expert_weights_norm for some files; these are its defaults where it does not).
_NORMALIZED_ROUTING = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True, "granitemoe": True,
                       "glm4moe": True}


def expert_fields(gguf_arch: str, shape, key) -> dict[str, Any]:
    """transformers config fields of a mixture-of-experts file (every layer's MLP one, as llama.cpp
    writes them), under each family's own names."""
    normalized = bool(key("expert_weights_norm", _NORMALIZED_ROUTING.get(gguf_arch, True)))
    qwen = ("qwen2moe", "qwen3moe", "qwen35moe", "qwen3next")
    count = "num_experts" if gguf_arch in (*qwen, "olmoe") else "num_local_experts"
    fields: dict[str, Any] = {count: shape.experts, "num_experts_per_tok": shape.experts_used,
                              "norm_topk_prob": normalized}
    if gguf_arch in qwen:
        fields |= {"moe_intermediate_size": shape.expert_ffn, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "shared_expert_intermediate_size": shape.shared_expert_ffn}
    elif gguf_arch == "deepseek2":
        pass  # the rest are _deepseek_fields'
    elif gguf_arch == "glm4moe":  # DeepSeek-V3's router: groups, scale, shared experts after dense layers
        fields |= {"moe_intermediate_size": shape.expert_ffn, "n_shared_experts": int(key("expert_shared_count", 0)),
                   "first_k_dense_replace": shape.dense_layers, "n_group": int(key("expert_group_count", 1)),
                   "topk_group": int(key("expert_group_used_count", 1)),
                   "routed_scaling_factor": float(key("expert_weights_scale", 1.0)), "num_nextn_predict_layers": 0}
    else:
        fields["intermediate_size"] = shape.expert_ffn
    return fields
