"""A tiny seeded random-weight Whisper checkpoint in Hugging Face layout (config, safetensors, generation
config, feature extractor, tokenizer with Whisper's special and timestamp tokens), for tests and demos.

    python -m crane_mp.testing.make_whisper --out DIR [--seed N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from crane_mp.testing.corpus import corpus
from crane_mp.testing.tokenizer import write_json

# The first languages of transformers' LANGUAGES table, in its order: WhisperTokenizer.prefix_tokens
# finds a language's token at <|startoftranscript|> + 1 + its index there.
LANGUAGES = ("en", "zh", "de", "es", "ru", "ko", "fr")
NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>
_TEXT_VOCAB = 400  # byte-level BPE: the 256 bytes plus merges
_CORPUS_SEED = 1234  # the tokenizer stays the same whatever the weights' seed
_SHAPE = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
          "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 80,
          "max_source_positions": 1500, "max_target_positions": 448}
# Suppressed like Whisper's non-speech symbols: some punctuation, and every byte that is not printable
# ASCII (alone it is not text), so decoded outputs are plain readable strings.
_NON_SPEECH = b'"#()*+/<=>@[]^_{|}~' + bytes([*range(32), *range(127, 256)])

# Init scales. Greedy tokens are compared across implementations, so logits must be peaked: the
# decoder's final norm carries LOGIT_SCALE over unit-norm embedding rows (the head is tied). Random
# decoders fall into one-token loops when every step's input looks alike, so what is constant is kept
# small (biases, the cross-attention's near-uniform average over 1500 audio positions) and what changes
# from step to step large (decoder positions). Timestamp rows are shorter, or Whisper's rule "sample a
# timestamp when their summed probability beats every text token" (1501 of them against ~400) would
# pick timestamps at every step; an EOS direction grows along the decoder positions, so windows end
# after tens of tokens, not at max_length.
LOGIT_SCALE = 6.0
TIMESTAMP_ROW_NORM = 0.55
EOS_DRIFT = 0.005  # per position, along the EOS embedding
POSITION_NORM = 3.0  # decoder position rows
CROSS_GAIN = 0.7  # encoder_attn.out_proj
OUT_GAIN = 1.5  # the other out_proj and fc2, so the blocks' outputs do not fade
NORM_NOISE = 0.1
BIAS_STD = 0.05

def _byte_tokens() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the token that spells each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _special_tokens() -> list[str]:
    return ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]


def _timestamp_tokens() -> list[str]:
    return ["<|%.2f|>" % (i * 0.02) for i in range(NUM_TIMESTAMPS)]


def _tokenizer():
    """WhisperTokenizer over a locally trained byte-level BPE: text ids first, then Whisper's special
    tokens in its order, then the timestamps (added, not special, as in the real vocabularies)."""
    from transformers import WhisperTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_TEXT_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # ASCII text only, so every merge is whole characters; the other byte tokens are suppressed.
    lines = [line.encode("ascii", "ignore").decode() for line in corpus(2000, seed=_CORPUS_SEED)]
    bpe.train_from_iterator(lines, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = WhisperTokenizer(vocab=model["vocab"], merges=[tuple(pair) for pair in model["merges"]])
    specials = _special_tokens()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(token, special=True, normalized=False) for token in specials[1:]]})
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in _timestamp_tokens()])
    return tokenizer


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's fixed encoder positions."""
    increment = math.log(10000) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1)


def _init_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(_tensor_seed(seed, name)))
    leaf, _, kind = name.rpartition(".")
    leaf = leaf.rpartition(".")[2]
    if name == "model.encoder.embed_positions.weight":
        return _sinusoids(*shape)
    if leaf == "embed_tokens":
        return noise / math.sqrt(shape[1])
    if leaf == "embed_positions":
        return POSITION_NORM * noise / math.sqrt(shape[1])
    if name == "model.decoder.layer_norm.weight":
        return LOGIT_SCALE * (1.0 + NORM_NOISE * noise)
    if "norm" in leaf:
        return 1.0 + NORM_NOISE * noise if kind == "weight" else NORM_NOISE * noise
    if kind == "bias":
        return BIAS_STD * noise
    if "encoder_attn.out_proj" in name:
        gain = CROSS_GAIN
    else:
        gain = OUT_GAIN if leaf in ("out_proj", "fc2") else 1.0
    return gain * noise / math.sqrt(math.prod(shape[1:]))  # fan in (a convolution's: channels x width)


def random_state_dict(config, seed: int, eos_token_id: int, timestamp_begin: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights named as transformers saves them (proj_out is tied, so omitted)."""
    from transformers import WhisperForConditionalGeneration

    with torch.device("meta"):
        skeleton = WhisperForConditionalGeneration(config)
    state = {name: _init_tensor(name, meta.shape, seed).contiguous()
             for name, meta in skeleton.state_dict().items() if name != "proj_out.weight"}
    tokens = state["model.decoder.embed_tokens.weight"]  # [vocab, d_model]
    tokens[timestamp_begin:] *= TIMESTAMP_ROW_NORM
    positions = state["model.decoder.embed_positions.weight"]  # [max_target_positions, d_model]
    eos_direction = tokens[eos_token_id] * math.sqrt(positions.shape[1])  # ~1 per dimension
    positions += EOS_DRIFT * torch.arange(positions.shape[0])[:, None] * eos_direction
    return state


def make_whisper(out: str | Path, seed: int = 0, english_only: bool = False) -> Path:
    """Write the checkpoint to `out` and return it. `english_only`: as whisper-*.en's generation config
    (no language or task tokens to choose, <|notimestamps|> forced after <|startoftranscript|>)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperProcessor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _special_tokens()}
    eos = ids["<|endoftext|>"]
    timestamp_begin = ids["<|notimestamps|>"] + 1
    task_ids = {task: ids[f"<|{task}|>"] for task in ("translate", "transcribe")}
    # As real multilingual checkpoints: non-speech symbols, then the control tokens (<|startofprev|>
    # second to last: generate falls back to suppress_tokens[-2] for it).
    suppress = sorted(tokenizer.convert_tokens_to_ids([_byte_tokens()[b] for b in _NON_SPEECH])) + [
        ids["<|startoftranscript|>"], task_ids["translate"], task_ids["transcribe"], ids["<|startoflm|>"],
        ids["<|startofprev|>"], ids["<|nocaptions|>"]]
    begin_suppress = [tokenizer.convert_tokens_to_ids("Ġ"), eos]
    config = WhisperConfig(vocab_size=len(tokenizer), **_SHAPE, pad_token_id=eos, bos_token_id=eos, eos_token_id=eos,
                           decoder_start_token_id=ids["<|startoftranscript|>"], suppress_tokens=suppress,
                           begin_suppress_tokens=begin_suppress)
    config.architectures = ["WhisperForConditionalGeneration"]
    config.dtype = "float32"
    write_json(out / "config.json", json.loads(config.to_json_string(use_diff=True)))
    languages = {"forced_decoder_ids": [[1, ids["<|notimestamps|>"]]], "is_multilingual": False} if english_only else {
        "forced_decoder_ids": [[1, None], [2, task_ids["transcribe"]]], "is_multilingual": True,
        "lang_to_id": {f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES}, "task_to_id": task_ids}
    write_json(out / "generation_config.json", {
        **languages,
        "alignment_heads": [[1, 0], [1, 2]],
        "begin_suppress_tokens": begin_suppress,
        "bos_token_id": eos,
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": eos,
        "max_initial_timestamp_index": 50,
        "max_length": _SHAPE["max_target_positions"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "pad_token_id": eos,
        "prev_sot_token_id": ids["<|startofprev|>"],
        "return_timestamps": False,
        "suppress_tokens": suppress,
        "transformers_version": transformers.__version__,
    })
    save_file(random_state_dict(config, seed, eos, timestamp_begin), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    feature_extractor = WhisperFeatureExtractor(feature_size=_SHAPE["num_mel_bins"])
    WhisperProcessor(feature_extractor, tokenizer).save_pretrained(str(out))
    feature_extractor.save_pretrained(str(out))  # preprocessor_config.json, as hub checkpoints have it
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_whisper(args.out, args.seed))


if __name__ == "__main__":
    main()
