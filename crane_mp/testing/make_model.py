"""Seeded random-weight checkpoints in Hugging Face layout (config, safetensors, tokenizer) for tests and benchmarks.

Run: python -m crane_mp.testing.make_model --arch qwen3 --size small --out DIR [--shards N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from crane_mp.models.registry import ARCHITECTURES
from crane_mp.testing.tokenizer import write_json, write_tokenizer


@dataclass(frozen=True)
class _Arch:
    """How our random checkpoints of one registry architecture are configured; its names come from registry.py."""

    name: str
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.name].hf_model_type

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.name].hf_classes[0]


ARCHS: dict[str, _Arch] = {arch.name: arch for arch in (
    _Arch("llama", 500000.0, 1e-5, False),
    _Arch("qwen2", 1000000.0, 1e-6, False, (("use_sliding_window", False),)),
    # Qwen3 at 0.6B-4B ties its embeddings; our models are far smaller still.
    _Arch("qwen3", 1000000.0, 1e-6, True, (("use_sliding_window", False),)),
    _Arch("mistral", 1000000.0, 1e-5, False, (("sliding_window", None),)),
    _Arch("hunyuan", 10000.0, 1e-5, True),
)}

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 2048},
    "small": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 1536, "vocab_size": 8192, "max_position_embeddings": 4096},
    # ~180M parameters: weights well above the runtime's own memory, for per-process memory figures.
    "medium": {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
               "head_dim": 64, "intermediate_size": 3072, "vocab_size": 16384, "max_position_embeddings": 4096},
}

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Init scales. Greedy tokens are compared across implementations, so logits must be peaked (top-1/top-2
# gaps far above float rounding). The final norm weight carries the logit scale: embedding and lm_head
# rows have unit norm, so logits have std ~LOGIT_SCALE whether or not the head is tied. Unit-norm
# embeddings also keep a tied head from simply echoing the input token, because the residual stream
# is dominated by the blocks' O(1) outputs rather than by the embedding.
LOGIT_SCALE = 6.0
OUT_GAIN = 1.5  # o_proj/down_proj: silu(gate)*up has variance well below 1, so blocks would otherwise fade
NORM_NOISE = 0.1  # norm weights 1 + noise, large enough that an engine ignoring them diverges
BIAS_STD = 0.2  # Qwen2's q/k/v biases: small but not negligible, for the same reason


def build_config(arch: str, size: str, *, dtype: str = "float32",
                 overrides: dict[str, Any] | None = None) -> PreTrainedConfig:
    """The transformers config for `arch` at `size`, with `overrides` applied last."""
    spec = ARCHS[arch]
    fields: dict[str, Any] = {
        **SIZES[size], "rope_theta": spec.rope_theta, "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings, "hidden_act": "silu", **dict(spec.extra),
        **(overrides or {}),
    }
    config = AutoConfig.for_model(spec.model_type, **fields)
    config.architectures = [spec.architecture]
    config.dtype = dtype
    return config


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor streams keep each tensor independent of iteration order and of other tensors' shapes.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _init_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in ("embed_tokens", "lm_head"):
        return noise / math.sqrt(shape[1])
    if name == "model.norm.weight":
        return LOGIT_SCALE * (1.0 + NORM_NOISE * noise)
    if "norm" in leaf:
        return 1.0 + NORM_NOISE * noise
    if kind == "bias":
        return BIAS_STD * noise
    if leaf in ("o_proj", "down_proj"):
        return OUT_GAIN * noise / math.sqrt(shape[1])
    if leaf.endswith("_proj"):
        return noise / math.sqrt(shape[1])
    raise ValueError(f"no init rule for tensor {name}")


def random_state_dict(config: PreTrainedConfig, seed: int, dtype: str) -> dict[str, torch.Tensor]:
    """Seeded weights named exactly as transformers' state_dict; lm_head is omitted when tied (as HF saves it)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tied = config.tie_word_embeddings
    return {
        name: _init_tensor(name, meta.shape, seed).to(DTYPES[dtype]).contiguous()
        for name, meta in skeleton.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def _split_shards(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    # Contiguous, byte-balanced groups; every shard gets at least one tensor.
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be in [1, {len(names)}], got {shards}")
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    slot, done = 0, 0
    for i, name in enumerate(names):
        later_shards = shards - 1 - slot
        full = done * shards >= (slot + 1) * total
        if groups[slot] and later_shards and (full or len(names) - i == later_shards):
            slot += 1
        groups[slot].append(name)
        done += sizes[name]
    return groups


def write_weights(state: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """model.safetensors, or `shards` files plus model.safetensors.index.json as HF writes them."""
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(state, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(state)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    weight_map: dict[str, str] = {}
    for i, group in enumerate(_split_shards(names, sizes, shards), start=1):
        filename = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({name: state[name] for name in group}, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


def _config_json(config: PreTrainedConfig) -> dict[str, Any]:
    data = json.loads(config.to_json_string(use_diff=True))
    # Mirror the pre-v5 spellings most hub checkpoints still carry, so raw-JSON readers see both forms;
    # transformers reconciles them to the same rope_parameters on load.
    rope = dict(config.rope_parameters)
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    data["torch_dtype"] = data["dtype"]
    return dict(sorted(data.items()))


def make_model(arch: str, size: str, out: str | Path, *, dtype: str = "float32", shards: int = 1,
               seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Write a seeded random checkpoint for `arch` ("llama", "qwen2", "qwen3", "mistral", "hunyuan") to `out`."""
    if arch not in ARCHS or size not in SIZES or dtype not in DTYPES:
        raise ValueError(f"unknown arch/size/dtype: {arch}/{size}/{dtype}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Leftover shards from an earlier run with another --shards would be picked up by loaders.
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()
    config = build_config(arch, size, dtype=dtype, overrides=overrides)
    ids = write_tokenizer(arch, config.vocab_size, config.max_position_embeddings, out)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = ids.bos, ids.eos, ids.pad
    if ids.eod is not None:
        config.eod_token_id = ids.eod
    write_json(out / "config.json", _config_json(config))
    write_json(out / "generation_config.json", {
        "bos_token_id": ids.bos, "eos_token_id": ids.generation_eos, "pad_token_id": ids.pad,
        "do_sample": False, "transformers_version": transformers.__version__,
    })
    write_weights(random_state_dict(config, seed, dtype), out, shards)
    return out


def _parse_set(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--size", required=True, choices=sorted(SIZES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--shards", default=1, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--set", dest="overrides", action="append", default=[], type=_parse_set,
                        metavar="KEY=VALUE", help="config field override; VALUE is parsed as JSON when possible")
    args = parser.parse_args(argv)
    out = make_model(args.arch, args.size, args.out, dtype=args.dtype, shards=args.shards, seed=args.seed,
                     overrides=dict(args.overrides))
    print(out)


if __name__ == "__main__":
    main()
