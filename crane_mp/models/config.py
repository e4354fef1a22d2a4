"""ModelConfig: the architecture facts our model code needs, read once from a Hugging Face config.

transformers is used here only to parse config.json (and rope parameters); model code never sees an HF object.
The architecture facts come from models/registry.py; no torch here, and nothing from the loaders or models.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from crane_mp.models.gguf_families import PROPORTIONAL_ROPE, family_fields
from crane_mp.models.gguf_file import LONGROPE_TENSORS, ROPE_TENSORS, SERVED_TYPES, check_gguf, rope_freq_factors
from crane_mp.models.layouts import (
    HYBRID_ARCHS,
    LINEAR,
    SLIDING,
    DecoderLayout,
    decoder_layout,
    split_rope,
    windowed_layer_types,
)
from crane_mp.models.registry import (
    ARCHITECTURES,
    HF_CLASSES,
    MODEL_TYPE_ALIASES,
    TRANSFORMERS,
    Architecture,
    supported,
)
from crane_mp.models.sharding import Shard


class UnsupportedModelError(ValueError):
    """The checkpoint is not one of the architectures crane-mp implements."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    rope_theta: float
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Encoders (registry `encoder`): the token that ends a pair's first text (its second text takes
    # token type 1, as the tokenizer's pair encoding marks it), and the first position id.
    sep_token_id: int | None = None
    first_position: int = 0
    # Tensor parallelism: the part of the model this rank holds (sharding.py); the sizes above are then
    # the rank's own, but for the vocabulary and hidden size. None: the whole model.
    shard: Shard | None = None
    # Qwen-VL's multimodal rope: how many of the head's frequencies follow the temporal, height and
    # width positions (in three runs, or interleaved t h w t h w ... as Qwen3-VL's); None: one position
    # per token.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    layout: DecoderLayout = DecoderLayout()
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def encoder(self) -> bool:
        return ARCHITECTURES[self.arch].encoder

    @property
    def media(self) -> str | None:
        return ARCHITECTURES[self.arch].media

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def activation_bytes_per_token(self) -> int:
        """A step token's live float32 tensors in one layer at its widest point (MLP gate/up and output,
        attention q/k/v/out): the memory plan's CPU estimate, and the router's before a model loads."""
        layout = self.layout
        intermediate = max(layout.layer_intermediate or (self.intermediate_size,))
        head_dim = max(self.head_dim, layout.global_head_dim or 0)
        kv_heads = max(self.num_key_value_heads, layout.global_kv_heads or 0)
        widths = (self.hidden_size * 4 + intermediate * 3 + (self.num_attention_heads + 2 * kv_heads) * head_dim * 2
                  + self.num_hidden_layers * layout.per_layer_input_size * 3)
        return widths * 4


MODEL_IMPLS = ("auto", "native", "transformers")  # --model-impl, vLLM's spelling

# Model types whose layers keep recurrent state (state-space or linear attention) rather than only a
# KV cache: the transformers backend, which gives every layer a paged KV cache, cannot serve them.
_RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h", "lfm2",
    "recurrent_gemma", "rwkv", "xlstm", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "minimax",
    "plamo2", "kimi_linear",
})
# Model types whose attention our paged attention does not compute as transformers does: the backend
# would serve wrong tokens (found with tiny checkpoints of each).
_BACKEND_GAPS = {
    "deepseek_v2": "multi-head latent attention (keys and values of other shapes than the queries')",
    "deepseek_v3": "multi-head latent attention (keys and values of other shapes than the queries')",
}
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def detect_arch(hf_config: Any, model_type: str = "auto", model_impl: str = "auto") -> str:
    """The registry row serving this checkpoint: its native architecture, else (with `model_impl`
    auto) the transformers backend when transformers can run it as a causal LM."""
    if model_impl not in MODEL_IMPLS:
        raise UnsupportedModelError(f"unknown --model-impl {model_impl!r} (one of {', '.join(MODEL_IMPLS)})")
    if model_impl == "transformers":
        return _transformers_arch(hf_config)
    if model_type != "auto":
        if model_type not in MODEL_TYPE_ALIASES:
            raise UnsupportedModelError(f"unknown --model-type {model_type!r}")
        return _native_or_backend(MODEL_TYPE_ALIASES[model_type], hf_config, model_impl)
    for name in getattr(hf_config, "architectures", None) or []:
        if name in HF_CLASSES:
            return _native_or_backend(HF_CLASSES[name], hf_config, model_impl)
    hf_type = getattr(hf_config, "model_type", "")
    arch = MODEL_TYPE_ALIASES.get(hf_type)
    if arch is not None and arch != TRANSFORMERS:
        return _native_or_backend(arch, hf_config, model_impl)
    if model_impl == "auto":
        return _transformers_arch(hf_config)
    raise UnsupportedModelError(f"model_type {hf_type!r} has no native implementation (native: {supported()}); "
                                "--model-impl auto or transformers serves it through transformers' modeling code")


def _native_gap(arch: str, hf_config: Any) -> str | None:
    """What of this checkpoint architecture `arch`'s native code does not implement (None: nothing)."""
    if arch == "olmoe" and getattr(hf_config, "clip_qkv", None) is not None:
        return "queries, keys and values clipped (clip_qkv)"
    if arch != "gemma4":
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, "enable_moe_block", False):
        return "Gemma 4's mixture-of-experts layers"
    if getattr(text, "use_bidirectional_attention", None) == "all":
        return "bidirectional attention"
    if getattr(text, "num_kv_shared_layers", 0) >= getattr(text, "num_hidden_layers", 1):
        return "every layer reading another model's keys and values (a draft model)"
    return None


def _native_or_backend(arch: str, hf_config: Any, model_impl: str) -> str:
    """`arch`, or where its native code lacks part of this checkpoint, the transformers backend (with
    --model-impl auto) or why not."""
    gap = _native_gap(arch, hf_config)
    if gap is None:
        return arch
    if model_impl == "auto":
        return _transformers_arch(hf_config)
    raise UnsupportedModelError(f"{arch} checkpoint with {gap}: not implemented natively yet; --model-impl auto "
                                "or transformers serves it through transformers' modeling code")


def _transformers_arch(hf_config: Any) -> str:
    """TRANSFORMERS, or why the transformers backend cannot serve this checkpoint."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf_type = getattr(hf_config, "model_type", "")
    if hf_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"model_type {hf_type!r} is not supported: no native implementation (native: {supported()}) and "
            "transformers has no causal LM for it")
    if hf_type in _RECURRENT_MODEL_TYPES:
        native = MODEL_TYPE_ALIASES.get(hf_type)
        remedy = (f"--model-impl native (or auto) serves it ({native}, with a state pool)" if native
                  else "it is not supported yet")
        raise UnsupportedModelError(f"model_type {hf_type!r} keeps recurrent state in its layers (state-space or "
                                    f"linear attention), which the transformers backend's paged KV cache cannot "
                                    f"hold; {remedy}")
    if hf_type in _BACKEND_GAPS:
        raise UnsupportedModelError(f"model_type {hf_type!r}: {_BACKEND_GAPS[hf_type]} is not computed by the "
                                    "transformers backend's paged attention; --model-impl native (or auto) serves it")
    _refuse_recurrent_layers(hf_config)
    import transformers

    # Code that computes attention itself (older models) would attend across the flattened batch.
    if not getattr(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_type]), "_supports_attention_backend",
                   False):
        raise UnsupportedModelError(
            f"model_type {hf_type!r}: transformers' code for it computes attention itself, not through its "
            "attention interface, so the transformers backend cannot run it on the paged KV cache; not supported")
    return TRANSFORMERS


def _refuse_recurrent_layers(hf_config: Any, arch: str = TRANSFORMERS) -> None:
    """A config whose layer_types name layers other than attention (a hybrid checkpoint) is refused by
    name, natively too, but for the linear-attention layers of the hybrids we implement (HYBRID_ARCHS):
    serving them as attention would give wrong tokens."""
    served = _ATTENTION_LAYER_TYPES | ({LINEAR} if arch in HYBRID_ARCHS else set())
    kinds = set(getattr(hf_config, "layer_types", None) or ()) - served
    if kinds:
        raise UnsupportedModelError(
            f"model_type {getattr(hf_config, 'model_type', '')!r} keeps recurrent state in its layers "
            f"({', '.join(sorted(kinds))}), which a paged KV cache cannot hold; it is not supported yet")


def checkpoint_architecture(model_dir: Path, model_type: str = "auto", model_impl: str = "auto",
                            ) -> Architecture | None:
    """The registry row of a safetensors checkpoint (None: no native row), read from config.json
    alone, so that the launcher decides the task before any process starts."""
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    names = SimpleNamespace(architectures=config.get("architectures"), model_type=config.get("model_type", ""))
    try:
        if model_impl == "transformers":
            return ARCHITECTURES[TRANSFORMERS]
        # Native rows only: the launcher stays free of transformers, and the backend's row is neither
        # an encoder nor a media model, which is all the launcher asks.
        return ARCHITECTURES[detect_arch(names, model_type, "native")]
    except UnsupportedModelError:
        return None


def _eos_ids(hf_config: Any, model_dir: Path | None) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    if model_dir is not None and (model_dir / "generation_config.json").exists():
        sources.append(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id"))
    for src in sources:
        for tok in src if isinstance(src, list) else [src]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def _rope(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """The global layers' (rope_theta, rope parameters). transformers >= 5 folds rope_theta into
    rope_parameters (per layer type for some families); 4.x keeps rope_theta + rope_scaling."""
    params, _ = split_rope(hf_config)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return theta, params


def _sliding_window(hf_config: Any, arch: str) -> int | None:
    """The attention window of the windowed layers, or None. Architectures marked `window_by_layer`
    (Qwen2, Qwen3) window only the layers from max_window_layers on, and only with use_sliding_window
    (layouts.windowed_layer_types says which; a mix of windowed and full layers is the layout's)."""
    window = getattr(hf_config, "sliding_window", None)
    if not ARCHITECTURES[arch].window_by_layer:
        return window
    return window if SLIDING in windowed_layer_types(hf_config) else None


def model_config_from_hf(hf_config: Any, model_type: str = "auto", model_dir: Path | None = None,
                         model_impl: str = "auto") -> ModelConfig:
    """Build our config from a loaded transformers config object."""
    arch = detect_arch(hf_config, model_type, model_impl)
    _refuse_recurrent_layers(hf_config, arch)
    if arch == TRANSFORMERS:
        return _transformers_config(hf_config, model_dir)
    if arch == "whisper":
        return _whisper_config(hf_config, model_dir)
    if ARCHITECTURES[arch].media == "image":
        return _vision_language_config(hf_config, arch, model_dir)
    text = getattr(hf_config, "text_config", None)
    if text is not None and text is not hf_config:
        # A vision-language checkpoint of a text family (Gemma 3 4B and up): its language model, served
        # for text; the model class skips the vision tower's tensors.
        config = model_config_from_hf(text, arch, model_dir)
        return dataclasses.replace(config, torch_dtype=_dtype_name(hf_config) or config.torch_dtype,
                                   tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings",
                                                                    config.tie_word_embeddings)))
    heads = hf_config.num_attention_heads
    head_dim = _base_attr(hf_config, "head_dim") or hf_config.hidden_size // heads
    layout = decoder_layout(arch, hf_config, head_dim)
    experts = getattr(hf_config, "num_local_experts", 0) or getattr(hf_config, "num_experts", 0)
    if experts and layout.experts is None:
        raise UnsupportedModelError(f"{arch} with {experts} experts per layer: its mixture-of-experts layers are "
                                    "not implemented natively")
    theta, rope_params = _rope(hf_config)
    sliding_window = _sliding_window(hf_config, arch)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    encoder = ARCHITECTURES[arch].encoder
    # RoBERTa numbers positions from padding_idx + 1, and its table holds that many fewer of them.
    first_position = hf_config.pad_token_id + 1 if encoder and arch != "bert" else 0
    return ModelConfig(
        arch=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        # Granite 4 names its (only) MLP the shared one; Qwen3.5-MoE has no dense MLP at all.
        intermediate_size=getattr(hf_config, "shared_intermediate_size", None)
        or getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=_base_attr(hf_config, "num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(hf_config, "rms_norm_eps", None) or hf_config.layer_norm_eps,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 2048) - first_position,
        tie_word_embeddings=not encoder and bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=encoder or bool(getattr(hf_config, "attention_bias", False)
                                       or getattr(hf_config, "qkv_bias", False)),  # Qwen2-MoE's name
        mlp_bias=encoder or bool(getattr(hf_config, "mlp_bias", False)),
        hidden_act=getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu"),
        rope_theta=theta,
        rope_parameters=rope_params,
        sliding_window=sliding_window,
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=_eos_ids(hf_config, model_dir),
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        sep_token_id=_sep_token_id(model_dir) if encoder else None,
        first_position=first_position,
        layout=layout,
        hf_config=hf_config,
    )


def _base_attr(hf_config: Any, name: str) -> Any:
    """head_dim or num_key_value_heads (None: absent); where it varies by layer (Gemma 4, whose global
    layers have their own: the layout's) its first sliding layer's."""
    try:
        return getattr(hf_config, name, None)
    except RuntimeError:  # transformers refuses the global read of a per-layer attribute
        kinds = list(hf_config.layer_types)
        return getattr(hf_config.per_layer_config[kinds.index(SLIDING) if SLIDING in kinds else 0], name, None)


def _transformers_config(hf_config: Any, model_dir: Path | None) -> ModelConfig:
    """What the engine needs of a model transformers runs: sizes for the KV cache and the memory plan
    (its attention modules may override the KV shape per layer), tokens, limits. Rope, norms and
    windows stay transformers' business. A vision-language checkpoint's sizes are its language model's."""
    top, hf_config = hf_config, hf_config.get_text_config()
    heads = hf_config.num_attention_heads
    hidden = hf_config.hidden_size
    eps = next((getattr(hf_config, name) for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon",
                                                      "layer_norm_epsilon") if getattr(hf_config, name, None)), 1e-6)
    return ModelConfig(
        arch=TRANSFORMERS, vocab_size=hf_config.vocab_size, hidden_size=hidden,
        intermediate_size=getattr(hf_config, "intermediate_size", None) or 4 * hidden,
        num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=_base_attr(hf_config, "num_key_value_heads") or heads,
        head_dim=_base_attr(hf_config, "head_dim") or hidden // heads, rms_norm_eps=eps,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", None) or 2048,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), attention_bias=False,
        mlp_bias=False, hidden_act="silu", rope_theta=10000.0, rope_parameters={"rope_type": "default"},
        bos_token_id=getattr(hf_config, "bos_token_id", None), eos_token_ids=_eos_ids(top, model_dir),
        torch_dtype=_dtype_name(top), hf_config=top,
    )


def _whisper_config(hf_config: Any, model_dir: Path | None) -> ModelConfig:
    """The decoder's facts (its KV cache is paged); the encoder reads the rest from hf_config."""
    heads = hf_config.decoder_attention_heads
    return ModelConfig(
        arch="whisper", vocab_size=hf_config.vocab_size, hidden_size=hf_config.d_model,
        intermediate_size=hf_config.decoder_ffn_dim, num_hidden_layers=hf_config.decoder_layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hf_config.d_model // heads,
        # Its logits read the token embedding itself (proj_out is tied): no lm_head for the loader to tie.
        rms_norm_eps=1e-5, max_position_embeddings=hf_config.max_target_positions, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, hidden_act=hf_config.activation_function, rope_theta=10000.0,
        bos_token_id=hf_config.decoder_start_token_id, eos_token_ids=_eos_ids(hf_config, model_dir),
        torch_dtype=_dtype_name(hf_config), hf_config=hf_config,
    )


# transformers' sections where a config names none (the interleaved ones need not fill the rotary dims).
_MROPE_DEFAULTS = {"qwen3_vl": (24, 20, 20), "qwen3_vl_moe": (24, 20, 20), "qwen3_5_vl": (11, 11, 10),
                   "qwen3_5_moe_vl": (11, 11, 10)}


def _vision_language_config(hf_config: Any, arch: str, model_dir: Path | None) -> ModelConfig:
    """The language model's facts from text_config (as its text family's row reads them), with its
    multimodal rope sections where the family has them; the vision tower reads vision_config from
    hf_config."""
    text = hf_config.text_config
    row = ARCHITECTURES[arch]
    config = model_config_from_hf(text, row.text_arch, model_dir)
    _, rope_params = _rope(text)
    section = rope_params.get("mrope_section") or _MROPE_DEFAULTS.get(arch)
    rotary_dim = config.layout.rotary_dim or config.head_dim
    if row.mrope == "sections" and (not section or sum(section) * 2 != rotary_dim):
        raise UnsupportedModelError(f"{arch} needs rope mrope_section summing to its {rotary_dim} rotary dims / 2, "
                                    f"not {section}")
    return dataclasses.replace(
        config, arch=arch, mrope_section=tuple(section) if row.mrope else None,
        mrope_interleaved=row.mrope == "interleaved", hf_config=hf_config,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", config.tie_word_embeddings)),
        torch_dtype=_dtype_name(hf_config) or config.torch_dtype)


def _dtype_name(hf_config: Any) -> str | None:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _sep_token_id(model_dir: Path | None) -> int | None:
    """An encoder's separator token, from its tokenizer (its config rarely names it)."""
    if model_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).sep_token_id


def load_model_config(model_path: str | Path, model_type: str = "auto", model_impl: str = "auto") -> ModelConfig:
    """Read config.json from a model directory."""
    from transformers import AutoConfig

    model_dir = Path(model_path)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    return model_config_from_hf(hf_config, model_type, model_dir, model_impl)


def load_gguf_config(path: Path, model_type: str = "auto") -> ModelConfig:
    """Our config from a GGUF file's metadata: the hyper-parameters become a transformers config (so
    rope variants resolve as for any checkpoint), tying follows the absence of output.weight,
    Llama 3's rope scaling comes from its rope_freqs tensor, and what a 2026 family adds (windows,
    scales, no-rope layers) from gguf_families.py."""
    from transformers import AutoConfig

    contents = check_gguf(path)
    shape, meta, names = contents.shape, contents.meta, contents.tensors
    arch = shape.row
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    # A 16-bit float file runs like a 16-bit checkpoint; a quantized one computes in float32 (auto dtype).
    matrix_types = {SERVED_TYPES[info.qtype] for info in names.values() if len(info.dims) == 2}
    float_kind = matrix_types & {"F16", "BF16"} if matrix_types <= {"F16", "BF16", "F32"} else set()
    rope_parameters = {"rope_theta": shape.rope_base, "rope_type": "default", **shape.rope_scaling}
    fields = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=shape.rms_eps, max_position_embeddings=shape.context,
        rope_parameters=rope_parameters, tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, mlp_bias="blk.0.ffn_up.bias" in names, hidden_act="silu",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=eos[0] if eos else None,
        use_sliding_window=False, sliding_window=None,
    )
    proportional = shape.gguf_arch in PROPORTIONAL_ROPE
    factors = {name: rope_freq_factors(path, names, name) for name in ROPE_TENSORS
               if name in names and (proportional or name in LONGROPE_TENSORS)}
    fields |= family_fields(shape.gguf_arch, shape, meta, names, factors)
    hf_config = AutoConfig.for_model(arch.hf_model_type, **fields)
    config = model_config_from_hf(hf_config, arch.name if model_type == "auto" else model_type)
    dtype = ("bfloat16" if "BF16" in float_kind else "float16") if float_kind else "float32"
    replace = {"eos_token_ids": tuple(dict.fromkeys(int(i) for i in eos)), "torch_dtype": dtype}
    if "rope_freqs.weight" in names and not proportional:
        replace["rope_parameters"] = {**config.rope_parameters, "freq_factors": rope_freq_factors(path, names)}
    return dataclasses.replace(config, **replace)
