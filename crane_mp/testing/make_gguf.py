"""Write a GGUF file from one of make_model's checkpoints, laid out as llama.cpp's converter lays it out.

Run: python -m crane_mp.testing.make_gguf --model DIR --out FILE.gguf --type Q4_K_M

Metadata (architecture, hyper-parameters, the full tokenizer, chat template) and tensor names follow
convert_hf_to_gguf.py, Llama's permuted q/k rows included, so a loader that reads these files reads
llama.cpp's. Types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and the mixes Q4_K_M / Q5_K_M
(attn_v, ffn_down and the output head one step up, as llama-quantize does). Norms and biases stay
F32; a matrix whose rows are not a whole number of blocks falls back to Q8_0, then F16.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

from crane_mp.models.registry import ARCHITECTURES, GGUF_ARCHITECTURES, PERMUTED_QK_ARCHS, gguf_name
from crane_mp.testing import kquants

# transformers' model types -> the general.architecture llama.cpp writes ("llama" for pre-v3 Mistral).
GGUF_ARCH = {arch.hf_model_type: arch.gguf_arch for arch in ARCHITECTURES.values()
             if arch.gguf_arch in GGUF_ARCHITECTURES}

MIXES = {"Q4_K_M": (T.Q4_K, T.Q6_K), "Q5_K_M": (T.Q5_K, T.Q6_K)}
_QUANTIZERS = {T.Q4_K: kquants.quantize_q4_k, T.Q5_K: kquants.quantize_q5_k, T.Q6_K: kquants.quantize_q6_k}
_BLOCK = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.F32: 1, T.F16: 1, T.BF16: 1}
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "Q4_K_M": 15, "Q5_K": 17, "Q5_K_M": 17,
               "Q6_K": 18, "BF16": 32}


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half row order -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pick_type(name: str, cols: int, wanted: str) -> int:
    """The type llama-quantize would give this matrix under `wanted`, with its fallbacks (a mixture of
    experts' router stays float32, as llama-quantize leaves it)."""
    if "ffn_gate_inp" in name:
        return T.F32
    if wanted in MIXES:
        base, high = MIXES[wanted]
        qtype = high if any(part in name for part in ("attn_v", "ffn_down", "output.")) else base
    else:
        qtype = T[wanted]
    for candidate in (qtype, T.Q8_0, T.F16):
        if cols % _BLOCK[candidate] == 0:
            return candidate
    return T.F32


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype in _QUANTIZERS:
        return _QUANTIZERS[qtype](w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict, printable_padding: bool = False) -> None:
    """The tokenizer of model_dir, padded to the model's vocabulary: with unused tokens, as llama.cpp
    pads, or (`printable_padding`) with ordinary tokens that each decode to a word of their own, so
    that every id a random-weight model samples prints something."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"])
    specials = {}
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
        specials[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [None] * config["vocab_size"]
    for text, idx in vocab.items():
        tokens[idx] = text
    for idx, text in enumerate(tokens):
        if text is None and printable_padding:
            tokens[idx] = f"\u0120w{idx}"  # " w<id>" in byte-level BPE's alphabet; no merge reaches it
        elif text is None:
            tokens[idx] = f"[PAD{idx}]"
            specials[idx] = gguf.TokenType.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")  # our tokenizers split with Qwen2's regex (see testing/tokenizer.py)
    writer.add_token_list(tokens)
    writer.add_token_types([specials.get(i, gguf.TokenType.NORMAL) for i in range(len(tokens))])
    writer.add_token_merges(merges)
    ids = {text: vocab[text] for text in vocab}
    for field, adder in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                         ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        if tok_config.get(field) is not None:
            adder(ids[tok_config[field]])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    writer.add_chat_template(tok_config["chat_template"])


def _rope_theta(config: dict, layer_type: str = "full_attention") -> float:
    rope = config.get("rope_parameters") or {}
    rope = rope.get(layer_type, rope) if isinstance(rope.get(layer_type), dict) else rope
    return float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def _write_family(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """What a 2026 family's file says beyond Llama's keys, as llama.cpp's converter writes it (the
    sliding pattern always as an array, which llama.cpp also reads, so any layer pattern round-trips)."""
    key = f"{arch}."
    kinds = config.get("layer_types") or []
    if config.get("sliding_window") and "sliding_attention" in kinds:
        writer.add_uint32(key + "attention.sliding_window", config["sliding_window"])
        writer.add_array(key + "attention.sliding_window_pattern", [kind == "sliding_attention" for kind in kinds])
    rope = config.get("rope_parameters") or {}
    if isinstance(rope.get("sliding_attention"), dict):
        writer.add_float32(key + "rope.freq_base_swa", _rope_theta(config, "sliding_attention"))
        full = rope["full_attention"]
        if full.get("rope_type") == "linear":
            writer.add_string(key + "rope.scaling.type", "linear")
            writer.add_float32(key + "rope.scaling.factor", float(full["factor"]))
    if rope.get("rope_type") == "longrope":
        writer.add_uint32(key + "rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # as llama.cpp's converter writes a mixture of experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    if "linear_attention" in kinds:  # Qwen3.5 / Qwen3-Next: the linear-attention widths, the layer pattern
        values = config["linear_num_value_heads"]
        for name, value in (("ssm.conv_kernel", config["linear_conv_kernel_dim"]),
                            ("ssm.state_size", config["linear_key_head_dim"]),
                            ("ssm.group_count", config["linear_num_key_heads"]), ("ssm.time_step_rank", values),
                            ("ssm.inner_size", values * config["linear_value_head_dim"]),
                            ("full_attention_interval", kinds.index("full_attention") + 1)):
            writer.add_uint32(key + name, value)
        writer.add_array(key + "rope.dimension_sections", [11, 11, 10, 0])  # llama.cpp's loader wants them
        if experts:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "phi3":
        writer.add_uint32(key + "attention.sliding_window", config.get("sliding_window") or 0)
    if arch == "cohere2":
        writer.add_float32(key + "logit_scale", float(config["logit_scale"]))
    for field, name in (("final_logit_softcapping", "final_logit_softcapping"),
                        ("attn_logit_softcapping", "attn_logit_softcapping"),
                        ("attention_multiplier", "attention.scale"), ("embedding_multiplier", "embedding_scale"),
                        ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
        if config.get(field) is not None:
            writer.add_float32(key + name, float(config[field]))


def _write_hparams(writer: gguf.GGUFWriter, config: dict, file_type: str) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor") if isinstance(rope.get("partial_rotary_factor"), float) else None
    # Partial rotary (Phi-3) as its converter counts the dims: of hidden / heads.
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // heads if partial else head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    if "layer_norm_eps" in config:  # Cohere's LayerNorm
        writer.add_layer_norm_eps(config["layer_norm_eps"])
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(_FILE_TYPES[file_type])


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """Llama 3's rope scaling as llama.cpp stores it: one divisor per frequency (rope_freqs.weight)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    base = float(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = np.clip((old_context / wavelen - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def make_gguf(model_dir: str | Path, out: str | Path, qtype: str = "Q8_0", name: str | None = None) -> Path:
    """Convert a make_model checkpoint (single safetensors file) to a GGUF file of type `qtype`.

    `name` is general.name (default: the directory's name). transformers reads a "llama" file whose
    name contains "mistral" as a Mistral model its GGUF loader then refuses: tests pick neutral names."""
    model_dir, out = Path(model_dir), Path(out)
    if qtype not in _FILE_TYPES:
        raise ValueError(f"unknown type {qtype}; choose from {', '.join(_FILE_TYPES)}")
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    if arch in ("gemma4", "granitehybrid"):
        raise ValueError(f"{arch}: its per-layer metadata is not written here; convert with llama.cpp's "
                         "convert_hf_to_gguf.py")
    served = GGUF_ARCHITECTURES[arch]  # the registry row reading the file
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or model_dir.name)
    _write_hparams(writer, config, qtype)
    _write_family(writer, arch, config)
    _write_tokenizer(writer, model_dir, config)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    factors = llama3_rope_factors(config)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    state = load_file(str(model_dir / "model.safetensors"))
    for hf_name in sorted(state):
        w = state[hf_name].astype(np.float32)
        name = gguf_name(hf_name, served.name)
        if served.gguf_norm_offset and name.endswith("norm.weight"):
            w = w + served.gguf_norm_offset
        if arch in PERMUTED_QK_ARCHS and (".attn_q." in name or ".attn_k." in name):
            w = permute_rows(w, heads if ".attn_q." in name else kv_heads)
        if w.ndim == 1:
            writer.add_tensor(name, w)
            continue
        chosen = pick_type(name, w.shape[1], qtype)
        data = quantize(w, chosen)
        writer.add_tensor(name, data, raw_dtype=None if chosen in (T.F32, T.F16) else chosen)
    finish(writer)
    return out


def finish(writer: gguf.GGUFWriter) -> None:
    """Write header, metadata and the added tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="a make_model checkpoint directory")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--type", default="Q8_0", choices=sorted(_FILE_TYPES))
    args = parser.parse_args(argv)
    print(make_gguf(args.model, args.out, args.type))


if __name__ == "__main__":
    main()
