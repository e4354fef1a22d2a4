"""How each decoder family's layers depart from Llama's, read once from its transformers config.

One reader per family in FAMILY_LAYOUTS; the layers (crane_mp/worker/models/layers.py) act on the
DecoderLayout and never see the transformers config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

SLIDING = "sliding_attention"
FULL = "full_attention"
LINEAR = "linear_attention"  # a Gated DeltaNet layer (Qwen3.5, Qwen3-Next): recurrent state, no KV cache


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """A mixture-of-experts MLP: its experts, and how a token picks `top_k` of them and weighs their outputs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # "softmax": a softmax over every expert's logit, then the top k (Qwen, Mixtral, OLMoE, DeepSeek-V2);
    # "topk_softmax": the top k logits, then a softmax over those (Granite); "sigmoid": each logit's
    # sigmoid, the top k chosen by it plus a learned correction bias (DeepSeek-V3, GLM-4.5).
    router: str = "softmax"
    normalize: bool = True  # the top k weights rescaled to sum to 1 (norm_topk_prob)
    scale: float = 1.0  # the weights are multiplied by it (routed_scaling_factor)
    # Group-limited choice (DeepSeek): the experts in `groups` equal groups, the top k taken from the
    # `topk_groups` groups scoring best, by their best expert ("max") or their best two's sum ("top2").
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    shared_intermediate_size: int = 0  # an expert every token goes through besides (Qwen2-MoE); 0: none
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid of a learned gate per token
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is a dense one of the config's intermediate size
    bias: bool = False  # the router and each expert's projections add a bias (gpt-oss)
    # gpt-oss's SwiGLU: gate clamped above at `swiglu_limit`, up within +-limit, out = (up + 1) *
    # gate * sigmoid(swiglu_alpha * gate); None: act(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    mxfp4: bool = False  # the checkpoint stores the experts' matrices as MXFP4 blocks, kept so in memory


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention: keys and values come from one `kv_rank`-wide latent per
    token (what the KV cache keeps, beside the `rope_dim` wide key part that carries position); each
    query head is `nope_dim` + `rope_dim` wide, each value head `v_dim`; queries through a `q_rank`
    bottleneck where it is set."""

    kv_rank: int
    q_rank: int | None
    nope_dim: int
    rope_dim: int
    v_dim: int


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid model (layer_types' "linear_attention"): `key_heads` query/key
    heads of `key_dim`, `value_heads` value heads of `value_dim` (a multiple of the key heads), a causal
    depthwise convolution `conv_kernel` wide over the projected queries, keys and values. Each sequence
    keeps per layer a convolution state (the last conv_kernel - 1 inputs) and a recurrent state
    [value_heads, key_dim, value_dim] (worker/cache/state_pool.py)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    # Qwen3-Next's b and a projections as one, rows grouped by key head ([b, a] of its value heads each).
    grouped_ba: bool = False
    # Value heads ordered j * key_heads + g for key head g (llama.cpp's Qwen3.5 files), not g * ratio + j.
    tiled_value_heads: bool = False

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """Where a decoder family departs from Llama's layer; the defaults are Llama's."""

    # Per layer: "full_attention" or "sliding_attention" (the window is ModelConfig.sliding_window);
    # empty: every layer alike, windowed when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] = ()
    rope_layers: tuple[bool, ...] = ()  # per layer: whether it applies rope (False: NoPE); empty: every layer
    # Rope parameters (with rope_theta) of the sliding layers where they differ from the global layers'.
    sliding_rope: dict[str, Any] | None = None
    rotary_dim: int | None = None  # partial rotary: the leading dims rope turns; None: all of head_dim
    rope_interleaved: bool = False  # rope turns pairs (2i, 2i + 1) (GLM, Cohere) instead of the halves
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attention_out_bias: bool | None = None  # o_proj's bias where it differs from q/k/v's (attention_bias)
    attn_softcap: float | None = None  # attention logits -> softcap * tanh(logits / softcap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden), Granite)
    residual_scale: float = 1.0  # each block's output before the residual add (Granite)
    logit_scale: float = 1.0  # output logits are multiplied by it (Cohere; Granite: 1 / logits_scaling)
    norm: str = "rms"  # "rms"; "gemma": x * (1 + w) in float32; "layer": mean-centred, weight only (Cohere)
    # "pre" (Llama); "sandwich": norms before and after attention and MLP (Gemma, GLM-4); "post": after
    # only (OLMo 2, EXAONE 4); "parallel": attention and MLP side by side on one norm (Cohere).
    block: str = "pre"
    round_embedding_scale: bool = False  # the embedding scale is rounded to the model dtype first (Gemma)
    # Gemma 4: the full-attention layers' own head size and KV heads, where they differ from the config's.
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    values_are_keys: bool = False  # the full-attention layers' values are their keys' projection (k_eq_v)
    value_norm: bool = False  # values go through a scale-less per-head RMSNorm before the cache
    # Per layer: the layer whose KV cache it reads (itself; an earlier one where layers share KV and
    # it projects no keys or values); empty: every layer its own.
    kv_sources: tuple[int, ...] = ()
    layer_intermediate: tuple[int, ...] = ()  # per layer: the MLP's width where layers differ
    per_layer_input_size: int = 0  # Gemma 4's per-layer input embeddings: their width per layer (0: none)
    per_layer_input_vocab: int = 0  # and the rows of their table
    experts: ExpertLayout | None = None  # mixture-of-experts MLPs (every layer but experts.dense_layers)
    # A learned logit per query head beside the keys' (gpt-oss): it takes its share of the softmax and
    # adds nothing to the output.
    attention_sinks: bool = False
    latent: LatentAttention | None = None  # DeepSeek's multi-head latent attention
    qk_norm: bool = False  # per-head query and key RMSNorms before rope, where a family has them optionally
    linear: LinearAttention | None = None  # the layers layer_types calls "linear_attention" (hybrid models)
    # Each query head's output scaled by sigmoid of a gate the query projection makes beside it (Qwen3.5).
    attention_gate: bool = False

    def window(self, layer: int, sliding_window: int | None) -> int | None:
        """Layer `layer`'s attention window (None: it sees every earlier key)."""
        if not self.layer_types:
            return sliding_window
        return sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_kind(self, layer: int) -> str | None:
        """"global", "sliding" (the sliding layers' own table) or None (no rope) for layer `layer`."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        sliding = bool(self.layer_types) and self.layer_types[layer] == SLIDING
        return "sliding" if sliding and self.sliding_rope is not None else "global"

    @property
    def varies_by_layer(self) -> bool:
        """Whether layers differ in their weights' shapes (LoRA and tensor parallelism assume not)."""
        return bool(self.global_head_dim or self.global_kv_heads or self.values_are_keys or self.kv_sources
                    or len(set(self.layer_intermediate)) > 1)

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a linear-attention (Gated DeltaNet) layer rather than attention."""
        return self.linear is not None and self.layer_types[layer] == LINEAR

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.experts is not None and layer not in self.experts.dense_layers

    def is_global(self, layer: int) -> bool:
        return not self.layer_types or self.layer_types[layer] != SLIDING

    def head_shape(self, layer: int, head_dim: int, kv_heads: int) -> tuple[int, int]:
        """(head size, KV heads) of layer `layer`; the config's are `head_dim` and `kv_heads`."""
        if self.global_head_dim is None or not self.is_global(layer):
            return head_dim, kv_heads
        return self.global_head_dim, self.global_kv_heads or kv_heads

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    def intermediate_size(self, layer: int, default: int) -> int:
        return self.layer_intermediate[layer] if self.layer_intermediate else default


def split_rope(hf_config: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global rope parameters, the sliding layers' where the config gives each layer type its own)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if isinstance(params.get(FULL), dict):
        full, sliding = dict(params[FULL], layer_type=FULL), dict(params.get(SLIDING) or params[FULL])
        sliding["layer_type"] = SLIDING
        same = {k: v for k, v in sliding.items() if k != "layer_type"} == {
            k: v for k, v in full.items() if k != "layer_type"}
        return full, None if same else sliding
    return params, None


def windowed_layer_types(hf_config: Any) -> tuple[str, ...]:
    """Qwen2/Qwen3's layer kinds: the layers from max_window_layers on slide, and only with
    use_sliding_window (transformers' layer_types lists them)."""
    if getattr(hf_config, "sliding_window", None) is None or not getattr(hf_config, "use_sliding_window", False):
        return ()
    return tuple(getattr(hf_config, "layer_types", None) or [
        SLIDING if i >= getattr(hf_config, "max_window_layers", 0) else FULL for i in range(hf_config.num_hidden_layers)
    ])


def _qwen(hf_config: Any, head_dim: int) -> DecoderLayout:
    kinds = windowed_layer_types(hf_config)
    return DecoderLayout(layer_types=kinds if len(set(kinds)) > 1 else ())


def _qwen_moe(hf_config: Any, head_dim: int) -> DecoderLayout:
    """Qwen2-MoE and Qwen3-MoE: experts in every decoder_sparse_step-th layer but mlp_only_layers;
    Qwen2-MoE's shared expert behind a sigmoid gate, and no bias on o_proj."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    layers = hf_config.num_hidden_layers
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    experts = ExpertLayout(
        hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
        # Qwen3-VL-MoE's text config names neither: it always renormalises, and every layer has experts.
        normalize=bool(getattr(hf_config, "norm_topk_prob", True)), shared_intermediate_size=shared,
        shared_gate=bool(shared), dense_layers=tuple(i for i in range(layers) if i in (
            getattr(hf_config, "mlp_only_layers", None) or ()) or (i + 1) % step))
    return dataclasses.replace(_qwen(hf_config, head_dim), experts=experts, attention_out_bias=False)


def _mixtral(hf_config: Any, head_dim: int) -> DecoderLayout:
    """Mixtral (and OLMoE, whose renormalising is optional): experts of the config's intermediate size."""
    return DecoderLayout(experts=ExpertLayout(hf_config.num_local_experts, hf_config.num_experts_per_tok,
                                              hf_config.intermediate_size,
                                              normalize=bool(getattr(hf_config, "norm_topk_prob", True))))


def _granite_moe(hf_config: Any, head_dim: int) -> DecoderLayout:
    experts = ExpertLayout(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                           router="topk_softmax")
    return dataclasses.replace(_granite(hf_config, head_dim), experts=experts)


def _gpt_oss(hf_config: Any, head_dim: int) -> DecoderLayout:
    """gpt-oss: sliding and global layers with attention sinks; experts with biases, the top k logits
    softmaxed, and a clamped SwiGLU."""
    quantization = getattr(hf_config, "quantization_config", None) or {}
    experts = ExpertLayout(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                           router="topk_softmax", bias=True, swiglu_limit=float(hf_config.swiglu_limit),
                           swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
                           mxfp4=quantization.get("quant_method") == "mxfp4")
    return DecoderLayout(layer_types=_layer_types(hf_config), experts=experts, attention_sinks=True)


def _deepseek(hf_config: Any, head_dim: int) -> DecoderLayout:
    """DeepSeek-V2/V3: latent attention (its softmax scale grown by yarn's mscale), dense MLPs in the first
    layers, then experts with shared ones: V2's routed by softmax (group-limited where topk_method says),
    V3's by sigmoid with a correction bias, groups scored by their best two."""
    v3 = hf_config.model_type == "deepseek_v3"
    group_limited = v3 or getattr(hf_config, "topk_method", "greedy") == "group_limited_greedy"
    experts = ExpertLayout(
        hf_config.n_routed_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
        router="sigmoid" if v3 else "softmax", normalize=v3 and bool(hf_config.norm_topk_prob),
        scale=float(hf_config.routed_scaling_factor),
        shared_intermediate_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
        dense_layers=tuple(range(hf_config.first_k_dense_replace)),
        groups=(hf_config.n_group or 1) if group_limited else 1,
        topk_groups=(hf_config.topk_group or 1) if group_limited else 1, group_score="top2" if v3 else "max")
    latent = LatentAttention(hf_config.kv_lora_rank, hf_config.q_lora_rank, hf_config.qk_nope_head_dim,
                             hf_config.qk_rope_head_dim, hf_config.v_head_dim)
    rope, _ = split_rope(hf_config)
    scale = (latent.nope_dim + latent.rope_dim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    interleaved = bool(getattr(hf_config, "rope_interleave", True)) if v3 else True
    return DecoderLayout(experts=experts, latent=latent, attention_scale=scale, rope_interleaved=interleaved)


def _glm4_moe(hf_config: Any, head_dim: int) -> DecoderLayout:
    """GLM-4.5: rope on the leading part of each head (halves), per-head query/key norms where
    use_qk_norm says, no bias on o_proj, DeepSeek-V3's router with shared experts after the first dense
    layers."""
    experts = ExpertLayout(
        hf_config.n_routed_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size, router="sigmoid",
        normalize=bool(hf_config.norm_topk_prob), scale=float(hf_config.routed_scaling_factor),
        shared_intermediate_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
        dense_layers=tuple(range(hf_config.first_k_dense_replace)), groups=hf_config.n_group or 1,
        topk_groups=hf_config.topk_group or 1, group_score="top2")
    return DecoderLayout(rotary_dim=_rotary_dim(hf_config, head_dim), attention_out_bias=False, experts=experts,
                         qk_norm=bool(getattr(hf_config, "use_qk_norm", False)))


def _qwen3_5(hf_config: Any, head_dim: int) -> DecoderLayout:
    """Qwen3.5 and Qwen3-Next: Gated DeltaNet layers between gated attention layers (three to one in the
    released sizes), (1 + w) norms, rope on a quarter of each head; experts with a gated shared one
    (the MoE variants, Qwen2-MoE's router)."""
    experts = None
    if getattr(hf_config, "num_experts", 0):
        layers, step = hf_config.num_hidden_layers, getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = getattr(hf_config, "mlp_only_layers", None) or ()
        experts = ExpertLayout(
            hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
            normalize=bool(getattr(hf_config, "norm_topk_prob", True)),
            shared_intermediate_size=hf_config.shared_expert_intermediate_size, shared_gate=True,
            dense_layers=tuple(i for i in range(layers) if i in dense or (i + 1) % step))
    linear = LinearAttention(hf_config.linear_num_key_heads, hf_config.linear_num_value_heads,
                             hf_config.linear_key_head_dim, hf_config.linear_value_head_dim,
                             hf_config.linear_conv_kernel_dim, grouped_ba=hf_config.model_type == "qwen3_next",
                             tiled_value_heads=bool(getattr(hf_config, "gguf_tiled_value_heads", False)))
    return DecoderLayout(layer_types=tuple(hf_config.layer_types), rotary_dim=_rotary_dim(hf_config, head_dim),
                         norm="gemma", experts=experts, linear=linear, attention_gate=True)


def _layer_types(hf_config: Any) -> tuple[str, ...]:
    kinds = tuple(getattr(hf_config, "layer_types", None) or ())
    return kinds if SLIDING in kinds else ()


def _rotary_dim(hf_config: Any, head_dim: int) -> int | None:
    full, _ = split_rope(hf_config)
    factor = full.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
    return None if factor == 1.0 else int(head_dim * factor)


def _gemma(hf_config: Any, head_dim: int) -> DecoderLayout:
    _, sliding = split_rope(hf_config)
    return DecoderLayout(
        layer_types=_layer_types(hf_config), sliding_rope=sliding,
        attention_scale=hf_config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        final_softcap=getattr(hf_config, "final_logit_softcapping", None),
        embedding_scale=math.sqrt(hf_config.hidden_size), norm="gemma", block="sandwich", round_embedding_scale=True)


def _gemma4(hf_config: Any, head_dim: int) -> DecoderLayout:
    """Gemma 4 (text): plain (x * w) norms around attention and MLP, attention scale 1, the global
    layers' own head shape and (proportional) rope, the last layers reading earlier layers' KV."""
    kinds = tuple(hf_config.layer_types)
    per_layer = hf_config.per_layer_config
    shapes = {kind: {(per_layer[i].head_dim, per_layer[i].num_key_value_heads)
                     for i in range(len(kinds)) if kinds[i] == kind} for kind in set(kinds)}
    if any(len(shape) > 1 for shape in shapes.values()):
        raise ValueError(f"gemma4: layers of one kind with different head shapes {shapes}")
    base = next(iter(shapes.get(SLIDING) or shapes[FULL]))
    full_shape = next(iter(shapes.get(FULL) or {base}))
    full, sliding = split_rope(hf_config)
    layers = hf_config.num_hidden_layers
    first_shared = layers - hf_config.num_kv_shared_layers
    # A sharing layer reads the cache of the last layer of its kind before the shared ones.
    sources = tuple(i if i < first_shared else max(j for j in range(first_shared) if kinds[j] == kinds[i])
                    for i in range(layers))
    wide = 2 if hf_config.use_double_wide_mlp else 1
    return DecoderLayout(
        layer_types=kinds if SLIDING in kinds else (), sliding_rope=sliding or dict(full, layer_type=SLIDING),
        attention_scale=1.0, final_softcap=getattr(hf_config, "final_logit_softcapping", None),
        embedding_scale=math.sqrt(hf_config.hidden_size), round_embedding_scale=True, block="sandwich",
        global_head_dim=full_shape[0] if full_shape != base else None,
        global_kv_heads=full_shape[1] if full_shape != base else None,
        values_are_keys=bool(hf_config.attention_k_eq_v), value_norm=True,
        kv_sources=sources if first_shared < layers else (),
        layer_intermediate=tuple(hf_config.intermediate_size * (wide if i >= first_shared else 1)
                                 for i in range(layers)),
        per_layer_input_size=hf_config.hidden_size_per_layer_input or 0,
        per_layer_input_vocab=hf_config.vocab_size_per_layer_input or 0)


def _olmo(hf_config: Any, head_dim: int) -> DecoderLayout:
    _, sliding = split_rope(hf_config)
    return DecoderLayout(layer_types=_layer_types(hf_config), sliding_rope=sliding, block="post")


def _exaone4(hf_config: Any, head_dim: int) -> DecoderLayout:
    kinds = _layer_types(hf_config)
    # With a window, only the sliding layers turn queries and keys; the global ones are NoPE.
    rope = tuple(kind == SLIDING for kind in kinds) if getattr(hf_config, "sliding_window", None) else ()
    return DecoderLayout(layer_types=kinds, rope_layers=rope, block="post")


def _cohere2(hf_config: Any, head_dim: int) -> DecoderLayout:
    kinds = _layer_types(hf_config)
    return DecoderLayout(layer_types=kinds, rope_layers=tuple(kind == SLIDING for kind in kinds),
                         rope_interleaved=True, logit_scale=float(hf_config.logit_scale), norm="layer",
                         block="parallel")


def _granite(hf_config: Any, head_dim: int) -> DecoderLayout:
    return DecoderLayout(attention_scale=float(hf_config.attention_multiplier),
                         embedding_scale=float(hf_config.embedding_multiplier),
                         residual_scale=float(hf_config.residual_multiplier),
                         logit_scale=1.0 / float(hf_config.logits_scaling))


def _granite4(hf_config: Any, head_dim: int) -> DecoderLayout:
    """Granite 4 dense: Granite's multipliers; rope only where position_embedding_type says "rope"."""
    rope = () if hf_config.position_embedding_type == "rope" else (False,) * hf_config.num_hidden_layers
    return DecoderLayout(rope_layers=rope, attention_scale=float(hf_config.attention_multiplier),
                         embedding_scale=float(hf_config.embedding_multiplier),
                         residual_scale=float(hf_config.residual_multiplier),
                         logit_scale=1.0 / float(hf_config.logits_scaling))


def _smollm3(hf_config: Any, head_dim: int) -> DecoderLayout:
    return DecoderLayout(rope_layers=tuple(bool(use) for use in hf_config.no_rope_layers))


def _phi3(hf_config: Any, head_dim: int) -> DecoderLayout:
    return DecoderLayout(rotary_dim=_rotary_dim(hf_config, head_dim))


def _glm4(hf_config: Any, head_dim: int) -> DecoderLayout:
    return DecoderLayout(rotary_dim=_rotary_dim(hf_config, head_dim), rope_interleaved=True,
                         attention_out_bias=False, block="sandwich")


def _seed_oss(hf_config: Any, head_dim: int) -> DecoderLayout:
    return DecoderLayout(attention_out_bias=bool(hf_config.attention_out_bias))


# Our architectures with linear-attention layers (layout.linear): their sequences keep recurrent state.
HYBRID_ARCHS = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl"})

# Our architecture name -> its layout reader; the rest are Llama's layer.
FAMILY_LAYOUTS: dict[str, Callable[[Any, int], DecoderLayout]] = {
    "gemma2": _gemma, "gemma3": _gemma, "gemma4": _gemma4, "olmo2": _olmo, "olmo3": _olmo, "exaone4": _exaone4,
    "cohere2": _cohere2, "granite": _granite, "smollm3": _smollm3, "phi3": _phi3, "glm4": _glm4,
    "seed_oss": _seed_oss, "granite4": _granite4, "qwen2": _qwen, "qwen3": _qwen,
    "qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "mixtral": _mixtral, "olmoe": _mixtral, "granitemoe": _granite_moe,
    "gpt_oss": _gpt_oss, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "glm4_moe": _glm4_moe,
    "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5, "qwen3_next": _qwen3_5,
}


def decoder_layout(arch: str, hf_config: Any, head_dim: int) -> DecoderLayout:
    read = FAMILY_LAYOUTS.get(arch)
    return read(hf_config, head_dim) if read is not None else DecoderLayout()
