"""Tiny seeded checkpoints of the 2026 model families, each built from transformers' own config class.

Every family gets the shapes that exercise its differences: both layer kinds of its attention pattern
(sliding and global layers, rope and no-rope layers) with a window a short prompt crosses, GQA, its
multipliers off their defaults. Weights follow make_model.py's rules (peaked logits, norms off 1) by
tensor name, so any family's state dict gets them.

Run: python -m crane_mp.testing.make_zoo --family gemma3_text --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from crane_mp.models.layouts import FULL, SLIDING
from crane_mp.testing.make_model import BIAS_STD, LOGIT_SCALE, NORM_NOISE, OUT_GAIN, _tensor_seed, write_weights
from crane_mp.testing.tokenizer import write_json, write_tokenizer

WINDOW = 6  # sliding layers' window: the tests' prompts are longer
_SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # make_zoo_model sets its tokenizer's
_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}

# transformers' model_type -> the config fields that make its tiny checkpoint exercise the family.
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": {"layer_types": _MIXED, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}}},
    # Gemma 3 4B and up: a vision-language checkpoint, its language model served for text.
    "gemma3": {"text_config": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "full_attention"], "sliding_window": WINDOW,
                               "query_pre_attn_scalar": 24},
               "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
               "mm_tokens_per_image": 4},
    # Phi-4-mini's shape of rope: partial, LongRoPE (the tests' sequences stay within its original context).
    "phi3": {"num_key_value_heads": 2, "original_max_position_embeddings": 64,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0],
                                 "original_max_position_embeddings": 64}},
    "olmo2": {},
    "olmo3": {"layer_types": _MIXED, "sliding_window": WINDOW},
    "smollm3": {"no_rope_layers": [1, 1, 0, 1], "no_rope_layer_interval": 3},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 2.0},
    "glm4": {"attention_bias": True},
    "cohere2": {"layer_types": _MIXED, "sliding_window": WINDOW, "logit_scale": 0.5},
    "exaone4": {"layer_types": _MIXED, "sliding_window": WINDOW},
    "seed_oss": {"attention_bias": True, "attention_out_bias": False},
    # Gemma 4: per-layer input embeddings, global layers with their own head size, KV heads and
    # proportional rope whose values are their keys, the last layers (double-wide MLPs) reusing earlier
    # layers' keys and values. Every option at once (the released sizes each take some).
    "gemma4_text": {"layer_types": _MIXED, "sliding_window": WINDOW, "global_head_dim": 32,
                    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "use_double_wide_mlp": True,
                    "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512,
                    "final_logit_softcapping": 3.0},
    # Mixtures of experts: 8 experts, top 2, dense layers beside sparse ones where the family has them.
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
                  "shared_expert_intermediate_size": 48},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2, "embedding_multiplier": 3.0,
                   "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0},
    # gpt-oss: attention sinks, yarn rope; experts with biases behind a clamped SwiGLU.
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "layer_types": _MIXED, "sliding_window": WINDOW,
                "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}},
    # DeepSeek: latent attention (V2-Lite's plain query projection, V3's low-rank one), a dense first layer,
    # group-limited routing (V2's softmax, V3's sigmoid with its correction bias), shared experts, yarn's mscale.
    "deepseek_v2": {"num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": None,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 1.5},
    "deepseek_v3": {"num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 24,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 128,
                                        "rope_theta": 10000.0}},
    # GLM-4.5: partial rope, q/k/v biases, DeepSeek-V3's router over 2 groups, a shared expert, a dense first layer.
    "glm4_moe": {"attention_bias": True, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                 "routed_scaling_factor": 1.5,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # Hybrids: Gated DeltaNet layers (2 key heads, 4 value heads) and gated attention, both kinds twice.
    "qwen3_5_text": {"layer_types": _HYBRID, **_LINEAR},
    "qwen3_5_moe_text": {"layer_types": _HYBRID, **_LINEAR, "num_experts": 8, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "qwen3_next": {"layer_types": _HYBRID, **_LINEAR, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    # A Qwen3.5 checkpoint with its vision tower: its language model served for text.
    "qwen3_5": {"text_config": {"layer_types": _HYBRID, **_LINEAR},
                "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                  "out_hidden_size": 64, "patch_size": 14, "temporal_patch_size": 2}},
    # No native implementation: served by the transformers backend.
    "ernie4_5": {"use_bias": False},
    # Granite 4 dense (granite-4.0-micro): the hybrid family's config with attention in every layer.
    "granitemoehybrid": {"layer_types": ["attention"] * 4, "num_local_experts": 0, "shared_intermediate_size": 96,
                         "position_embedding_type": "rope", "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                         "attention_multiplier": 0.2, "logits_scaling": 2.0},
    "starcoder2": {"use_bias": True},
}


def _gemma3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """Gemma 3's real shape at one size: 5 sliding layers to 1 global, window 1024, 262k vocabulary."""
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 256, "vocab_size": 262144,
            "max_position_embeddings": 131072, "sliding_window": 1024, "query_pre_attn_scalar": 256,
            "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}


# Gemma 4 E2B's shape: 35 layers (4 sliding : 1 global, window 512), the last 20 reading earlier
# layers' KV with double-wide MLPs, 256-wide per-layer inputs, global layers of 512-wide heads.
_GEMMA4_E2B = {"hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
               "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "vocab_size": 262144,
               "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20,
               "use_double_wide_mlp": True, "attention_k_eq_v": False, "num_global_key_value_heads": None,
               "max_position_embeddings": 131072, "sliding_window": 512, "final_logit_softcapping": 30.0,
               "layer_types": [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)]}

# Real shapes for benchmarks (python -m crane_mp.testing.make_zoo --family gemma3_text --preset gemma3-4b).
PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-4b": _gemma3(2560, 10240, 34, 8, 4),
    "gemma3-12b": _gemma3(3840, 15360, 48, 16, 8),
    "gemma4-e2b": _GEMMA4_E2B,  # --family gemma4_text
}
_TRAINED_VOCAB = 16384  # larger vocabularies are padded with <unusedN> tokens
# Families whose released checkpoints are another class than the causal LM transformers maps them to
# (a vision-language model's, its tower included).
_CHECKPOINT_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration"}
# Families whose released checkpoints carry a multi-token-prediction layer (`mtp.*`), which
# transformers drops on loading: a few of its tensors are written besides.
_MTP_FAMILIES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
# Families whose whole prediction layer `prediction_layer` writes: after the last (num_nextn_predict_layers),
# or under mtp.*.
NEXTN_FAMILIES = frozenset({"deepseek_v3", "glm4_moe"})
PREDICTION_FAMILIES = NEXTN_FAMILIES | {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}


def build_zoo_config(family: str, overrides: dict[str, Any] | None = None) -> PreTrainedConfig:
    fields = FAMILIES[family]
    if "text_config" in fields:  # the tiny shape is the language model's
        fields = {**fields, "text_config": {**_SHAPE, **fields["text_config"]}}
    else:
        fields = {**_SHAPE, **fields}
    config = AutoConfig.for_model(family, **{**fields, **(overrides or {})})
    causal_lm = AutoModelForCausalLM._model_mapping[type(config)].__name__
    config.architectures = [_CHECKPOINT_CLASSES.get(family, causal_lm)]
    return config


_CHUNK = 1 << 26  # elements: larger matrices are drawn in row blocks, never whole in float32


def _init_tensor(name: str, shape: torch.Size, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    if len(shape) != 2 or shape.numel() <= _CHUNK:
        return _scaled(name, shape, torch.randn(shape, generator=gen, dtype=torch.float32)).to(dtype)
    out = torch.empty(shape, dtype=dtype)  # Gemma 4's per-layer embeddings: 2.3 B values
    rows = max(1, _CHUNK // shape[1])
    for start in range(0, shape[0], rows):
        block = torch.randn((min(rows, shape[0] - start), shape[1]), generator=gen, dtype=torch.float32)
        out[start : start + block.shape[0]] = _scaled(name, shape, block)
    return out


def _scaled(name: str, shape: torch.Size, noise: torch.Tensor) -> torch.Tensor:
    """Standard-normal `noise` scaled as tensor `name` of `shape` wants it."""
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if name == "model.norm.weight":
        return LOGIT_SCALE * (1.0 + NORM_NOISE * noise)
    if kind == "bias":
        return BIAS_STD * noise if "norm" not in leaf else NORM_NOISE * noise
    if len(shape) == 1:  # norms (and per-layer scalars): near 1, so that ignoring one changes tokens
        return 1.0 + NORM_NOISE * noise
    if leaf in ("embed_tokens", "lm_head", "wte"):
        return noise / math.sqrt(shape[1])
    gain = OUT_GAIN if leaf in ("o_proj", "down_proj", "dense", "c_proj") else 1.0
    return gain * noise / math.sqrt(shape[1])


def make_zoo_model(family: str, out: str | Path, *, seed: int = 0, overrides: dict[str, Any] | None = None,
                   dtype: str = "float32", prediction_layer: bool = False) -> Path:
    """Write family `family`'s tiny checkpoint (config, safetensors, tokenizer) to `out`;
    `prediction_layer`: with its multi-token-prediction layer (a NEXTN_FAMILIES family)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = build_zoo_config(family, overrides)
    text = config.get_text_config()
    trained = _TRAINED_VOCAB if text.vocab_size > _TRAINED_VOCAB else None
    ids = write_tokenizer("llama", text.vocab_size, text.max_position_embeddings, out, trained)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = ids.bos, ids.eos, ids.pad
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = getattr(transformers, config.architectures[0])._from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {name: _init_tensor(name, meta.shape, seed, getattr(torch, dtype)).contiguous()
             for name, meta in skeleton.state_dict().items() if not (tied and name == "lm_head.weight")}
    if prediction_layer:
        if family not in PREDICTION_FAMILIES:
            raise ValueError(f"the zoo writes no prediction layer for {family}")
        state |= _prediction_layer(skeleton, text, state, seed, getattr(torch, dtype), family in NEXTN_FAMILIES)
    state = _checkpoint_names(skeleton, state)
    if family in _MTP_FAMILIES and not prediction_layer:
        hidden = text.hidden_size
        state |= {name: _init_tensor(name, torch.Size(shape), seed, getattr(torch, dtype)) for name, shape in (
            ("mtp.fc.weight", (hidden, 2 * hidden)), ("mtp.pre_fc_norm_hidden.weight", (hidden,)),
            ("mtp.layers.0.self_attn.q_proj.weight", (2 * text.num_attention_heads * text.head_dim, hidden)),
            ("mtp.norm.weight", (hidden,)))}
    config.save_pretrained(out)
    _write_attention_interval(out, text)
    write_json(out / "generation_config.json", {
        "bos_token_id": ids.bos, "eos_token_id": ids.generation_eos, "pad_token_id": ids.pad,
        "do_sample": False, "transformers_version": transformers.__version__,
    })
    write_weights(state, out, 1)
    return out


def _prediction_layer(skeleton: torch.nn.Module, text: PreTrainedConfig, state: dict[str, torch.Tensor], seed: int,
                      dtype: torch.dtype, nextn: bool) -> dict[str, torch.Tensor]:
    """The multi-token-prediction layer: a full-attention decoder layer of the family, the norms and
    projection joining an embedding and a hidden state, and its head's norm. DeepSeek-V3's and GLM-4.5's
    (`nextn`) as model.layers.{num_hidden_layers}.* with copies of the embedding and the head, as their
    released checkpoints hold them; Qwen3.5's and Qwen3-Next's as mtp.*."""
    index, hidden = text.num_hidden_layers, text.hidden_size
    longer = copy.deepcopy(text)
    if getattr(text, "layer_types", None):
        longer.layer_types = [*text.layer_types, "full_attention"]
    with torch.device("meta"):
        layer = type(skeleton.model.layers[-1])(longer, layer_idx=index)
    prefix = f"model.layers.{index}." if nextn else "mtp."
    names = (("enorm", "hnorm", "eh_proj", "shared_head.norm") if nextn
             else ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"))
    shapes = {prefix + ("" if nextn else "layers.0.") + name: meta.shape for name, meta in layer.state_dict().items()}
    shapes |= {f"{prefix}{names[0]}.weight": (hidden,), f"{prefix}{names[1]}.weight": (hidden,),
               f"{prefix}{names[2]}.weight": (hidden, 2 * hidden)}
    out = {name: _init_tensor(name, torch.Size(shape), seed, dtype) for name, shape in shapes.items()}
    head_norm = f"{prefix}{names[3]}.weight"  # scaled as the final norm: logits as peaked as the model's
    noise = torch.randn(hidden, generator=torch.Generator().manual_seed(_tensor_seed(seed, head_norm)))
    out[head_norm] = (LOGIT_SCALE * (1.0 + NORM_NOISE * noise)).to(dtype)
    if nextn:
        out[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        out[prefix + "shared_head.head.weight"] = state.get("lm_head.weight",
                                                            state["model.embed_tokens.weight"]).clone()
    return out


def _write_attention_interval(out: Path, text: PreTrainedConfig) -> None:
    """A hybrid's config.json also names its pattern by full_attention_interval, as the released ones do
    (transformers reads it into layer_types and saves only those; llama.cpp's converter reads it)."""
    kinds = list(getattr(text, "layer_types", None) or ())
    if "linear_attention" not in kinds:
        return
    interval = kinds.index("full_attention") + 1
    assert all((kind == "full_attention") == ((i + 1) % interval == 0) for i, kind in enumerate(kinds)), kinds
    config = json.loads((out / "config.json").read_text())
    (config.get("text_config") or config)["full_attention_interval"] = interval
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under the names save_pretrained writes: transformers 5 keeps a layer's experts stacked
    in memory and writes one tensor per expert, as the released checkpoints have them."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # 4.x: the names in memory are the checkpoint's
        return state
    return {name: tensor.contiguous() for name, tensor in revert_weight_conversion(model, state).items()}


def make_mxfp4_experts(model_dir: Path, out: Path) -> Path:
    """gpt-oss's released form of `model_dir`'s checkpoint (a gpt_oss zoo model) in `out`: its experts'
    matrices as MXFP4 blocks and scales, the config naming the quantization. `model_dir`'s experts
    become the blocks' dequantized values: the float reference the MXFP4 checkpoint must match."""
    from safetensors.torch import load_file

    from crane_mp.worker.quantized.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(model_dir / "model.safetensors"))
    reference, released = dict(state), {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out]
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            released |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            reference[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            released[name] = tensor
    write_weights(reference, model_dir, 1)
    write_weights(released, out, 1)
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape instead of the tiny one")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prediction-layer", action="store_true",
                        help="with the multi-token-prediction layer the released checkpoints carry "
                             f"({', '.join(sorted(PREDICTION_FAMILIES))})")
    args = parser.parse_args(argv)
    print(make_zoo_model(args.family, args.out, seed=args.seed, dtype=args.dtype,
                         overrides=PRESETS[args.preset] if args.preset else None,
                         prediction_layer=args.prediction_layer))


if __name__ == "__main__":
    main()
