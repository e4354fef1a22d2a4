"""Load a checkpoint into our model classes: safetensors, single file or sharded, memory-mapped."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import psutil
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.models.config import ModelConfig
from crane_mp.models.gguf_file import ModelSource, check_gguf
from crane_mp.worker.models.build import build_meta_model, materialize
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.models.moe import SparseMoE
from crane_mp.worker.platforms import Platform
from crane_mp.worker.quantized.formats import LAYOUTS
from crane_mp.worker.quantized.gguf_loader import load_gguf_model
from crane_mp.worker.quantized.layers import GGUFExperts
from crane_mp.worker.weights.cpu_packing import pack_linear_weights, spare_copies_fit
from crane_mp.worker.weights.load_progress import LoadProgress
from crane_mp.worker.weights.offload import HostExperts


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iter_safetensors(files: list[Path], progress: bool,
                     wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The files' tensors by name (`wanted`: only the names it accepts, the others never read)."""
    from safetensors import safe_open

    total = 0
    handles = []
    for path in files:
        handle = safe_open(str(path), framework="pt", device="cpu")  # mmap: tensors are paged in on access
        names = [name for name in handle.keys() if wanted is None or wanted(name)]
        handles.append((handle, names))
        total += len(names)
    with LoadProgress(total, "weights", progress) as bar:
        for handle, names in handles:
            for name in names:
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_model(
    config: ModelConfig, source: ModelSource, dtype: torch.dtype, platform: Platform, progress: bool = True,
    embed_only: bool = False, lora: bool = False, int8_activations: bool = False,
    host_experts: HostExperts | None = None, drop_file_pages: bool = False,
) -> tuple[CausalLM, Counter]:
    """The model with its weights, and the file's tensor types (GGUF's; for safetensors the experts an
    MXFP4 checkpoint keeps in GGUF's MXFP4 rows, else none).
    `embed_only`: an embedding model, served without logits, may lack the lm_head. `lora`: LoRA
    adapters will be applied (no activation fused into a packed projection). `int8_activations`: GGUF
    matmuls on 8-bit activations (Platform.int8_matmuls). `host_experts`: a GGUF file's layers whose experts
    stay in host memory (weights/offload.py). `drop_file_pages`: a GGUF file's pages leave the page
    cache once copied into the model's own memory (--keep-page-cache unset)."""
    if source.format == "gguf":
        model, types = load_gguf_model(config, source.gguf_file, dtype, platform, progress, int8_activations,
                                       host_experts, drop_file_pages)
    else:
        model = load_safetensors_model(config, source.model_dir, dtype, platform, progress, embed_only,
                                       int8_activations)
        experts = config.layout.experts
        types = Counter({"MXFP4": 2 * sum(config.layout.sparse(layer) for layer in range(config.num_hidden_layers))}
                        if experts is not None and experts.mxfp4 else {})
    if platform.pack_bf16_weights(dtype) and getattr(model, "packs_linears", True):
        pack_linear_weights(model, spare=spare_copies_fit(model, psutil.virtual_memory().total),
                            fuse_activation=not lora)
    return model.eval(), types


def load_safetensors_model(
    config: ModelConfig, model_dir: str | Path, dtype: torch.dtype, platform: Platform, progress: bool = True,
    embed_only: bool = False, int8_activations: bool = False,
) -> CausalLM:
    """Build the model without initialising it (meta device), then fill every parameter from the checkpoint."""
    model = build_meta_model(config, dtype, platform)
    device = platform.device
    experts = config.layout.experts
    if experts is not None and experts.mxfp4:
        mxfp4_experts(model, platform, int8_activations)
    materialize(model, device)
    if config.tie_word_embeddings:
        model.tie_weights()
    loaded = model.load_weights(iter_safetensors(safetensors_files(Path(model_dir)), progress))
    missing = model.expected_weights() - loaded
    if embed_only and "lm_head.weight" in missing:
        # Nothing reads an embedding model's logits but /health_generate's one token: a one-row stub
        # instead of vocabulary x hidden uninitialised memory (1.2 GB for an 8B model) taken from the KV cache.
        model.lm_head = torch.nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=dtype)
        model.vocab_parallel = False
        torch.nn.init.zeros_(model.lm_head.weight)
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model


def mxfp4_experts(model: torch.nn.Module, platform: Platform, int8: bool) -> None:
    """Each mixture's experts as GGUF MXFP4 rows the kernels read (gate and up rows in one stack, down
    in another), allocated on the device for the loader to fill: an MXFP4 checkpoint's experts stay
    4.25 bits a weight in memory."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, SparseMoE):
            continue
        dense, layout = module.experts, module.layout
        hidden, width, count = module.gate.in_features, layout.intermediate_size, layout.num_experts
        block = LAYOUTS[T.MXFP4]

        def stack(rows: int, columns: int) -> torch.Tensor:
            return torch.empty(count, rows, columns // block.block * block.bytes, dtype=torch.uint8,
                               device=platform.device)

        with torch.device("meta"):  # the biases: allocated with the rest of the model
            module.experts = GGUFExperts(hidden, width, [(T.MXFP4, stack(2 * width, hidden))],
                                         (T.MXFP4, stack(hidden, width)), platform.gguf, int8, dense.act,
                                         dense.ops, layout)


def file_tensor_bytes(source: ModelSource) -> int:
    """Bytes of tensor data in the model's files (what a quantized model should occupy in memory)."""
    if source.format == "gguf":
        return check_gguf(source.gguf_file).tensor_bytes
    return sum(path.stat().st_size for path in safetensors_files(source.model_dir))


def weight_bytes(model: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes of parameters and (packed-weight) buffers, each tensor counted once; `device`: only those
    it holds (a GPU's, less the experts kept in host memory)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]
               if device is None or t.device.type == device.type}
    return sum(t.numel() * t.element_size() for t in tensors.values())
