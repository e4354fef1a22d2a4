"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), served beside the
base model: a request names its adapter, and requests of different adapters and of the base model run
in the same forward.

An adapter's q/k/v (and gate/up) matrices are stacked to match our fused projections: A = [A_q; A_k;
A_v] and a block-diagonal B that writes each part's rows, with alpha / r folded into B (both stored
transposed). In a step, each linear adds (x_rows @ A^T) @ B^T to the rows of each adapter present (one
pair of GEMMs per adapter and projection, gathered by row index; forward_context.LoraBatch), so a
batch with k adapters costs k small GEMM pairs per projection whatever its size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from crane_mp.models.config import ModelConfig
from crane_mp.models.sharding import Shard, whole_config
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.platforms import Platform

# Bytes per element of the safetensors dtypes an adapter may hold (anything else counts as 8).
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

# PEFT target module -> (our projection, part index within it); parts are laid out in this order.
_TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_MODULES = {target: module for module, target in _TARGETS.items()}
_UNSUPPORTED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform")


class LoraError(ValueError):
    """An adapter crane-mp cannot serve; the message names the adapter and the reason."""


def _projections(model: CausalLM, layer: int) -> dict[str, torch.nn.Module]:
    decoder = model.model.layers[layer]
    return {"qkv_proj": decoder.self_attn, "o_proj": decoder.self_attn,
            "gate_up_proj": decoder.mlp, "down_proj": decoder.mlp}


def _part_sizes(model: CausalLM, projection: str) -> list[int]:
    cfg = model.config
    if projection == "qkv_proj":
        return [cfg.num_attention_heads * cfg.head_dim, cfg.kv_size, cfg.kv_size]
    if projection == "gate_up_proj":
        return [cfg.intermediate_size, cfg.intermediate_size]
    return [cfg.hidden_size]  # o_proj, down_proj


# adapter_config.json is a few hundred bytes; anything far larger is not one.
_MAX_CONFIG_BYTES = 1 << 20


def read_adapter(path: str | Path, name: str, max_rank: int, max_bytes: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config and tensors; LoraError for anything this server cannot apply exactly. The
    tensors are read only once the file's header shows at most `max_bytes` of them (the largest adapter
    of rank --max-lora-rank this model can have). Messages never quote the files' contents."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    config = _read_config(config_file, name)
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: its peft_type is not LORA")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {key} is not supported")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise LoraError(f"LoRA adapter {name!r}: only bias='none' and fan_in_fan_out=false are supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json needs a positive integer r")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    return config, _read_tensors(weights_file, name, max_bytes)


def _read_config(config_file: Path, name: str) -> dict:
    if config_file.stat().st_size > _MAX_CONFIG_BYTES:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json is over {_MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    return config


def _read_tensors(weights_file: Path, name: str, max_bytes: int) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as handle:
            total = 0
            for key in handle.keys():
                tensor = handle.get_slice(key)
                total += math.prod(tensor.get_shape()) * _ITEM_BYTES.get(tensor.get_dtype(), 8)
            if total > max_bytes:
                raise LoraError(f"LoRA adapter {name!r}: its tensors take {total} bytes, more than an adapter of "
                                f"rank --max-lora-rank for this model can ({max_bytes})")
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except LoraError:
        raise
    except Exception:  # noqa: BLE001 - safetensors' own errors may quote the header
        raise LoraError(f"LoRA adapter {name!r}: adapter_model.safetensors is not a readable safetensors file") from None


def build_adapter(model: CausalLM, config: dict, tensors: dict[str, torch.Tensor], name: str,
                  dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A^T [in, parts * r], B^T [parts * r, out]) with the scaling folded into B,
    in `dtype`."""
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A or B matrix")
            continue
        module_path = key.split(".lora_A.")[0]
        fields = module_path.split(".")
        if "layers" not in fields or fields[-1] not in _TARGETS:
            raise LoraError(f"LoRA adapter {name!r}: {module_path} is not a supported target "
                            f"({', '.join(_TARGETS)} of a decoder layer)")
        layer = int(fields[fields.index("layers") + 1])
        if not 0 <= layer < model.config.num_hidden_layers:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} is not in this model")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise LoraError(f"LoRA adapter {name!r}: {module_path} has lora_A but no lora_B")
        projection, part = _TARGETS[fields[-1]]
        parts.setdefault((layer, projection), {})[part] = (tensor, b)

    built = {}
    for (layer, projection), by_part in parts.items():
        sizes = _part_sizes(model, projection)
        in_features = model.config.hidden_size if projection != "down_proj" else model.config.intermediate_size
        if projection == "o_proj":
            in_features = model.config.num_attention_heads * model.config.head_dim
        a_rows, b_blocks, offset = [], [], 0
        for part, size in enumerate(sizes):
            if part in by_part:
                a, b = _rank_part(model.config.shard, _MODULES[projection, part], *by_part[part], name)
                if a.shape != (rank, in_features) or b.shape != (size, rank):
                    raise LoraError(f"LoRA adapter {name!r}: layer {layer} {projection} part {part} has shapes "
                                    f"{tuple(a.shape)} / {tuple(b.shape)}, expected ({rank}, {in_features}) / "
                                    f"({size}, {rank}): an adapter for another model?")
                a_rows.append(a)
                block = torch.zeros(sum(sizes), rank, dtype=b.dtype)
                block[offset : offset + size] = b * scaling
                b_blocks.append(block)
            offset += size
        a_t = torch.cat(a_rows).t().to(device=device, dtype=dtype).contiguous()
        b_t = torch.cat(b_blocks, dim=1).t().to(device=device, dtype=dtype).contiguous()
        built[(layer, projection)] = (a_t, b_t)
    if not built:
        raise LoraError(f"LoRA adapter {name!r}: no LoRA matrices found")
    return built


def _rank_part(shard: Shard | None, module: str, a: torch.Tensor, b: torch.Tensor,
               name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor-parallel rank's part of one projection's adapter: B's rows of a column-parallel
    projection, A's columns of a row-parallel one (whose partial products the ranks sum)."""
    split = shard.split(f"{module}.weight") if shard is not None else None
    if split is None:
        return a, b
    whole = b if split.axis == 0 else a.t()
    if whole.dim() != 2 or whole.shape[0] != shard.whole(module):
        raise LoraError(f"LoRA adapter {name!r}: {module} has shapes {tuple(a.shape)} / {tuple(b.shape)}, not "
                        f"{shard.whole(module)} wide where the model is: an adapter for another model?")
    if split.axis == 0:
        return a, b[split.start : split.stop]
    return a[:, split.start : split.stop], b


def install(model: CausalLM, lora_id: int, adapter: dict) -> None:
    """Make adapter `lora_id` available to the model's projections (module.lora_<projection>)."""
    for (layer, projection), pair in adapter.items():
        getattr(_projections(model, layer)[projection], f"lora_{projection}")[lora_id] = pair


def uninstall(model: CausalLM, lora_id: int) -> None:
    for layer in range(model.config.num_hidden_layers):
        for projection, module in _projections(model, layer).items():
            getattr(module, f"lora_{projection}").pop(lora_id, None)


def adapter_bytes(config: ModelConfig, rank: int, dtype: torch.dtype) -> int:
    """What an adapter of this rank adapting every projection of every layer takes (build_adapter's
    layout: A^T [in, parts * r] and a block-diagonal B^T [parts * r, out] per fused projection)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    per_layer = sum(len(parts) * rank * (in_features + sum(parts)) for in_features, parts in (
        (hidden, (q_size, config.kv_size, config.kv_size)), (q_size, (hidden,)),
        (hidden, (inter, inter)), (inter, (hidden,))))
    return config.num_hidden_layers * per_layer * dtype.itemsize


def load_adapter(model: CausalLM, lora_id: int, name: str, path: str, max_rank: int, dtype: torch.dtype,
                 platform: Platform) -> int:
    """Read, check and install one adapter under `lora_id`; returns the bytes it takes."""
    # The file holds the whole model's matrices, whichever part of them this rank keeps.
    config, tensors = read_adapter(path, name, max_rank, adapter_bytes(whole_config(model.config), max_rank,
                                                                       torch.float32))
    adapter = build_adapter(model, config, tensors, name, platform.lora_dtype(dtype), platform.device)
    install(model, lora_id, adapter)
    return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in adapter.values())


def load_adapters(model: CausalLM, modules: tuple[tuple[str, str], ...], max_rank: int,
                  dtype: torch.dtype, platform: Platform) -> int:
    """Load --lora-modules (adapter i gets id i + 1); returns the bytes they take."""
    return sum(load_adapter(model, index + 1, name, path, max_rank, dtype, platform)
               for index, (name, path) in enumerate(modules))
