"""A GGUF file of any shape with random quantized weights, written straight as quantized blocks: an
8B-shape Q4_K_M (4.7 GB) in seconds, for memory and speed checks that no small model can stand in for.

Run: python -m crane_mp.testing.random_gguf --out qwen3-8b-q4_k_m.gguf [--shape 8b|1.7b|0.6b|small] [--type Q4_K_M]
     python -m crane_mp.testing.random_gguf --out gemma3-12b-q4_k_m.gguf --shape gemma3-12b   (make_zoo's presets)
     python -m crane_mp.testing.random_gguf --out a3b.gguf --shape qwen3-30b-a3b [--layers 24]   (experts)
     python -m crane_mp.testing.random_gguf --out qwen3.5.gguf --shape qwen3.5   (Gated DeltaNet layers)
     python -m crane_mp.testing.random_gguf --out target.gguf --silent-layers-from 2   (with a draft:
     python -m crane_mp.testing.random_gguf --out draft.gguf --layers 2   the same first layers, agreeing)

Every block gets random quant bits and a fixed small scale (so weights stay in a trained model's range
and the forward pass stays finite); norms are ones. Metadata and tensor names are make_gguf's, and the
tokenizer is a small trained one (8192 tokens) padded to the model's vocabulary with tokens that
each print a word of their own (" w12345"), and the output rows of the tokens that print nothing
alone (special tokens, lone bytes of a multi-byte character) are zero, so greedy decoding never picks
them: a streaming client sees text for every token. The text means nothing; what it costs in memory
and time is an 8B model's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from crane_mp.models.registry import GGUF_ARCHITECTURES, gguf_name
from crane_mp.testing.make_gguf import GGUF_ARCH, _write_family, _write_hparams, _write_tokenizer, finish, pick_type
from crane_mp.testing.make_model import _config_json, build_config
from crane_mp.testing.make_zoo import PRESETS, build_zoo_config
from crane_mp.testing.tokenizer import write_json, write_tokenizer

SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
           "tie_word_embeddings": False},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False},
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": True},
    "small": {"tie_word_embeddings": False},
}
# Other families: (transformers model type, shape). Qwen3-30B-A3B: 48 layers of 128 experts, 8 a token.
FAMILY_SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                                    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                    "vocab_size": 151936, "max_position_embeddings": 40960,
                                    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                                    "moe_intermediate_size": 768, "norm_topk_prob": True}),
    # Qwen3.5's shape as Qwen3_5TextConfig's defaults give it (9B: 32 layers, three Gated DeltaNet layers
    # to one attention layer).
    "qwen3.5": ("qwen3_5_text", {"tie_word_embeddings": False}),
}
_TOKENIZER_VOCAB = 8192
_PRESET_FAMILIES = {"gemma3-12b": "gemma3_text", "gemma3-4b": "gemma3_text"}
# Offsets of each block's float16 scale fields, and the value they get: weights of a few hundredths.
_SCALES = {T.Q8_0: ((0,), 2e-4), T.Q4_K: ((0, 2), 1e-4), T.Q6_K: ((208,), 1.5e-5)}
_ROWS_PER_CHUNK = 1024


def random_blocks(rows: int, cols: int, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bits with every block's scales set to a small finite value."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = cols // block_elems
    out = np.empty((rows, blocks * block_bytes), dtype=np.uint8)
    offsets, scale = _SCALES[qtype]
    scale_bytes = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = rng.integers(0, 256, size=(min(_ROWS_PER_CHUNK, rows - start), blocks, block_bytes), dtype=np.uint8)
        for offset in offsets:
            chunk[:, :, offset : offset + 2] = scale_bytes
        out[start : start + chunk.shape[0]] = chunk.reshape(chunk.shape[0], -1)
    return out


def silent_token_ids(tokenizer_json: Path) -> list[int]:
    """Ids that print nothing on their own: special tokens, and byte-level pieces of a character (a
    lone byte 0x80-0xFF, half of a CJK character): a stream of them shows a client no text at all."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return [i for i in range(tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip("\ufffd ")]


def random_gguf(out: str | Path, shape: str = "8b", qtype: str = "Q4_K_M", arch: str = "qwen3", seed: int = 0,
                layers: int | None = None, silent_from: int | None = None) -> Path:
    """`shape`: one of SHAPES (a make_model `arch`), FAMILY_SHAPES, or a make_zoo preset (its family);
    `layers`: fewer layers than the shape's (a model that fits the host); `silent_from`: the layers from
    this one on add nothing to the residual stream (their attention output and MLP down projections are
    zero blocks), yet are read as any layer is: a file of the same seed and `layers=silent_from` gives
    the same tokens at a fraction of the reading (a draft model that always agrees)."""
    out = Path(out)
    if shape in PRESETS:  # a 2026 family at a real shape (family from the preset's name)
        config = build_zoo_config(_PRESET_FAMILIES[shape], PRESETS[shape])
        arch = "llama"  # the tokenizer family
    elif shape in FAMILY_SHAPES:
        model_type, fields = FAMILY_SHAPES[shape]
        config = AutoConfig.for_model(model_type, **fields, dtype="bfloat16")
    else:
        config = build_config(arch, "small", dtype="bfloat16", overrides=SHAPES[shape])
    if layers is not None:
        config.num_hidden_layers = layers
    gguf_arch = GGUF_ARCH[config.model_type]
    served = GGUF_ARCHITECTURES[gguf_arch].name
    with tempfile.TemporaryDirectory() as tmp:
        ids = write_tokenizer(arch, min(_TOKENIZER_VOCAB, config.vocab_size), config.max_position_embeddings, Path(tmp))
        silent = silent_token_ids(Path(tmp) / "tokenizer.json")
        config.bos_token_id, config.eos_token_id, config.pad_token_id = ids.bos, ids.eos, ids.pad
        config_json = (json.loads(config.to_json_string()) if shape in PRESETS or shape in FAMILY_SHAPES
                       else _config_json(config))
        write_json(Path(tmp) / "config.json", config_json)
        writer = gguf.GGUFWriter(str(out), gguf_arch)
        writer.add_name(f"random-{gguf_arch}-{shape}")
        _write_hparams(writer, config_json, qtype)
        _write_family(writer, gguf_arch, config_json)
        _write_tokenizer(writer, Path(tmp), config_json, printable_padding=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(seed)
    for hf_name, meta in sorted(skeleton.state_dict().items()):
        if hf_name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            _write_experts(writer, hf_name, tuple(meta.shape), qtype, rng)
            continue
        name = gguf_name(hf_name, served)
        if hf_name.endswith(".linear_attn.A_log"):  # stored as -exp(A_log): decays of a trained model's size
            writer.add_tensor(name.removesuffix(".weight"), -np.full(meta.shape, 0.5, dtype=np.float32))
            continue
        if hf_name.endswith(".linear_attn.dt_bias"):
            writer.add_tensor(name.replace(".weight", ".bias"), np.zeros(meta.shape, dtype=np.float32))
            continue
        if meta.ndim == 1:  # norms of one (Gemma's stored as 1 + w: the same ones)
            writer.add_tensor(name, np.ones(meta.shape, dtype=np.float32))
            continue
        if hf_name.endswith(".conv1d.weight"):  # a depthwise convolution, [channels, kernel] in float32
            writer.add_tensor(name, (rng.standard_normal((meta.shape[0], meta.shape[2])) * 0.5).astype(np.float32))
            continue
        rows, cols = meta.shape
        chosen = pick_type(name, cols, qtype)
        if chosen == T.F32:  # a router, kept in float32: logits of about unit size
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32))
            continue
        if chosen not in _SCALES:
            raise ValueError(f"{name}: random blocks are written for Q8_0, Q4_K and Q6_K only, not {T(chosen).name}")
        blocks = random_blocks(rows, cols, chosen, rng)
        if silent_from is not None and _silenced(hf_name, silent_from):
            per_block = blocks.reshape(rows, -1, gguf.GGML_QUANT_SIZES[chosen][1])
            for offset in _SCALES[chosen][0]:
                per_block[:, :, offset : offset + 2] = 0
        if hf_name == ("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"):
            per_block = blocks.reshape(rows, -1, gguf.GGML_QUANT_SIZES[chosen][1])
            for offset in _SCALES[chosen][0]:  # zero rows: their logit 0 is never the largest of random ones
                per_block[silent, :, offset : offset + 2] = 0
        writer.add_tensor(name, blocks, raw_dtype=chosen)
    finish(writer)
    return out


def _silenced(hf_name: str, first: int) -> bool:
    """A projection writing into the residual stream, of a layer from `first` on."""
    parts = hf_name.split(".")
    return (hf_name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) and parts[1] == "layers"
            and int(parts[2]) >= first)


def _write_experts(writer: gguf.GGUFWriter, hf_name: str, shape: tuple[int, int, int], qtype: str,
                   rng: np.random.Generator) -> None:
    """A layer's stacked experts (transformers 5's [experts, rows, columns]) as llama.cpp's tensors:
    gate and up apart, each [experts, rows, row bytes] of random blocks."""
    layer = hf_name.split(".")[2]
    experts, rows, cols = shape
    parts = (("ffn_gate_exps", rows // 2), ("ffn_up_exps", rows // 2)) if hf_name.endswith("gate_up_proj") else (
        ("ffn_down_exps", rows),)
    for short, part_rows in parts:
        name = f"blk.{layer}.{short}.weight"
        chosen = pick_type(name, cols, qtype)
        blocks = random_blocks(experts * part_rows, cols, chosen, rng)
        writer.add_tensor(name, blocks.reshape(experts, part_rows, -1), raw_dtype=chosen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", default="8b", choices=sorted([*SHAPES, *FAMILY_SHAPES, *_PRESET_FAMILIES]))
    parser.add_argument("--type", default="Q4_K_M", choices=["Q4_K_M", "Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (to fit the host's memory)")
    parser.add_argument("--silent-layers-from", type=int, metavar="N",
                        help="layers from N on add nothing (zero output projections): a file of --layers N agrees")
    parser.add_argument("--seed", type=int, default=0, help="another seed: other weights, the same tokenizer")
    args = parser.parse_args(argv)
    print(random_gguf(args.out, args.shape, args.type, seed=args.seed, layers=args.layers,
                      silent_from=args.silent_layers_from))


if __name__ == "__main__":
    main()
