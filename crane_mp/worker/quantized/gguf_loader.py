"""Load a GGUF file into our model classes, quantized matrices kept quantized.

The model is built on the meta device; every projection with a quantized part becomes a GGUFLinear
(and a quantized token table a GGUFEmbedding) holding the file's blocks; only what is left (norms,
biases, float matrices) is then allocated and filled through the model's own `load_weights`, under
Hugging Face names (models/registry.py maps them). On CPU the quantized weights are the file's bytes,
repacked or copied into memory straight from a mapping of the file; the float tensors (norms,
biases) are a few MB besides.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.models.gguf_file import ROPE_TENSORS, TensorInfo, check_gguf, layer_of
from crane_mp.models.registry import ARCHITECTURES, PERMUTED_QK_ARCHS, gguf_layer_names, hf_name
from crane_mp.models.sharding import Shard
from crane_mp.worker.models.build import build_meta_model, materialize
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.platforms import Platform
from crane_mp.worker.quantized.file_reader import MappedFile, read_ranges
from crane_mp.worker.quantized.formats import LAYOUTS, dequantize
from crane_mp.worker.quantized.layers import GGUFEmbedding, GGUFExperts, GGUFLinear
from crane_mp.worker.weights.load_progress import LoadProgress
from crane_mp.worker.weights.offload import HostExperts

log = logging.getLogger(__name__)

# Float matrices in the compute dtype load as plain weights; any other type (F16 under float32
# compute, say) stays in the file's bytes, as quantized types do, so memory never exceeds the file.
_FLOAT_DTYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                 GGMLQuantizationType.BF16: torch.bfloat16}
# Our fused projections and the checkpoint modules that fill them, in row order.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",),
          # A mixture-of-experts layer's shared expert (Qwen2-MoE); its experts are GGUFExperts.
          "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
          "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
          # DeepSeek's latent attention: its query and latent projections (V2-Lite's q_proj stands alone).
          "self_attn.q_proj": ("self_attn.q_proj",), "self_attn.q_a_proj": ("self_attn.q_a_proj",),
          "self_attn.q_b_proj": ("self_attn.q_b_proj",),
          "self_attn.kv_a_proj_with_mqa": ("self_attn.kv_a_proj_with_mqa",),
          # A Gated DeltaNet layer's input and output projections (our module sits under self_attn).
          "self_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                "linear_attn.in_proj_a"),
          "self_attn.out_proj": ("linear_attn.out_proj",)}
# Where a family's file fills one of them from other tensors (Qwen3-Next: b and a in one).
_FUSED_ELSE = {"self_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_ba")}


def fused_groups(arch: str) -> dict[str, tuple[str, ...]]:
    """Our fused projections -> the GGUF tensors (short names) that fill them, in row order: one
    tensor each where the file fuses them as we do (Phi-3)."""
    by_module = {module: short for short, module in gguf_layer_names(arch).items()}
    groups: dict[str, tuple[str, ...]] = {}
    for ours, parts in [*_FUSED.items(), *_FUSED_ELSE.items()]:
        if ours not in groups and (ours in by_module or all(part in by_module for part in parts)):
            groups[ours] = (by_module[ours],) if ours in by_module else tuple(by_module[part] for part in parts)
    # A projection a fused group holds is no group of its own (q_proj where q/k/v fuse).
    fused = {part for ours, parts in _FUSED.items() if ours in groups and len(parts) > 1 for part in parts}
    return {ours: names for ours, names in groups.items() if ours not in fused}


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's interleaved rope rows -> Hugging Face's rotate-half order, per head (any row payload)."""
    tail = rows.shape[1:]
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *tail).transpose(1, 2).reshape(rows.shape).contiguous()


class _Tensors:
    """The file's tensors as torch row-byte tensors in anonymous memory (file_reader.py says why not
    a mapping). On CPU (`mapped`) the file is mapped and read ahead from the start: a tensor the
    kernels convert (`laid_out`: repacked rows) is converted straight from the mapping, any other
    is copied out of it, and the copies are the model's weights (GGUF blocks are what the kernels
    read). For CUDA each tensor is read on its own and copied to the device, so the host holds one
    at a time. close() when done."""

    def __init__(self, path: Path, infos: dict[str, TensorInfo], permute_heads: dict[str, int], mapped: bool,
                 release_copied: bool = False) -> None:
        self.path = path
        self.infos = infos
        self.permute_heads = permute_heads
        self.release_copied = release_copied
        self._file = MappedFile(path, [(i.offset, i.n_bytes) for i in infos.values()]) if mapped else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def qtype(self, name: str) -> int:
        return self.infos[name].qtype

    def rows(self, name: str) -> torch.Tensor:
        """[rows, row_bytes] uint8 in memory of its own (a 1-D tensor is one row; stacked experts' rows
        one after the other)."""
        out = self._owned(self._rows(name))
        self._release(name)
        return out

    def laid_out(self, name: str, layout) -> tuple[int, torch.Tensor]:
        """layout(rows) -> (type, rows as the kernels read them), given the mapping's bytes where
        they are mapped; whatever it keeps as it is comes back copied out of the mapping."""
        qtype, out = layout(self._rows(name))
        out = self._owned(out)
        self._release(name)
        return qtype, out

    def experts_laid_out(self, names: list[str], experts: int, layout) -> tuple[int, torch.Tensor]:
        """Stacked tensors [experts, rows, columns] of one type, each expert's rows laid out (layout(name,
        rows)) and its parts side by side: (type, [experts, rows of every part, row bytes]) in one
        allocation."""
        stacks = [(name, self._rows(name).unflatten(0, (experts, -1))) for name in names]  # each expert's rows
        out = None
        for expert in range(experts):
            laid = [layout(name, rows[expert]) for name, rows in stacks]
            qtype = laid[0][0]
            if out is None:
                out = torch.empty((experts, sum(part.shape[0] for _, part in laid), laid[0][1].shape[1]),
                                  dtype=torch.uint8, device=laid[0][1].device)
            start = 0
            for _, part in laid:  # copy_, not torch.cat(out=): cat copies bytes one at a time
                out[expert, start : start + part.shape[0]].copy_(part)
                start += part.shape[0]
        for name in names:
            self._release(name)
        return qtype, out

    def _release(self, name: str) -> None:
        """Tensor `name` is in memory of its own: its file pages leave the page cache (release_copied).
        Nothing else reads them, and on a VM that hands freed memory back to its host, the next
        tensor's copy reuses them where fresh memory costs the host a fault a page (1.1-1.3 s/GiB on
        our Firecracker guests: a 30B-A3B's experts load in 4-5 s instead of 18-20)."""
        if self._file is not None and self.release_copied:
            info = self.infos[name]
            self._file.release(info.offset, info.n_bytes)

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if self._file is not None and self._file.holds(tensor) else tensor

    def _rows(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        rows = math.prod(info.dims[:-1])  # a stack of experts' matrices: all of their rows
        if self._file is not None:
            out = torch.from_numpy(self._file.view(info.offset, info.n_bytes)).view(rows, -1)
        else:
            [raw] = read_ranges(self.path, [(info.offset, info.n_bytes)])
            out = torch.from_numpy(raw).view(rows, -1)
        heads = self.permute_heads.get(name.split(".")[-2]) if name.startswith("blk.") else None
        if heads is not None:  # a copy of its own (copy-on-write pages where mapped), in Hugging Face's order
            out.copy_(_unpermute(out if len(info.dims) > 1 else out.view(-1, LAYOUTS[info.qtype].bytes), heads)
                      .view(rows, -1))
        return out

    def floats(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        dims = self.infos[name].dims
        return dequantize(self.rows(name), self.qtype(name), dims[-1]).reshape(dims).to(dtype)


def _shard_rows(shard: Shard, name: str, hf: str, rows: torch.Tensor, qtype: int) -> tuple[int, torch.Tensor]:
    """This rank's part of a matrix of GGUF rows (sharding.py) and its type: whole rows, or whole
    blocks of each row. A share of the columns that would cut blocks (a small model's shapes) is
    dequantized and kept as float32, exactly the values the blocks hold."""
    split = shard.split(hf)
    if split is None:
        return qtype, rows
    if split.axis == 0:
        part = rows[split.start : split.stop]
        if split.rows > part.shape[0]:  # zero bytes are zero weights in every type
            part = torch.cat([part, part.new_zeros(split.rows - part.shape[0], part.shape[1])])
        return qtype, part
    layout = LAYOUTS[qtype]
    if split.start % layout.block or split.stop % layout.block:
        columns = rows.shape[1] // layout.bytes * layout.block
        log.warning("%s: a rank's share of its columns, [%d, %d), cuts %s blocks of %d; this rank keeps it "
                    "as float32", name, split.start, split.stop, GGMLQuantizationType(qtype).name, layout.block)
        dense = dequantize(rows, qtype, columns)[:, split.start : split.stop].contiguous()
        return GGMLQuantizationType.F32, dense.view(torch.uint8)
    first, last = split.start // layout.block * layout.bytes, split.stop // layout.block * layout.bytes
    return qtype, rows[:, first:last].contiguous()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def load_gguf_model(
    config: ModelConfig, path: Path, dtype: torch.dtype, platform: Platform, progress: bool = True,
    int8: bool = False, host_experts: HostExperts | None = None, drop_file_pages: bool = False,
) -> tuple[CausalLM, Counter]:
    """Returns the model and the file's tensor types (a Counter of type names) for the start-up log.
    `int8`: quantized projections take 8-bit activations (Platform.int8_matmuls decided). `host_experts`:
    layers whose experts stay in host memory, on the CPU platform's kernels (weights/offload.py).
    `drop_file_pages`: each tensor's file pages leave the page cache once copied (one rank alone: a
    tensor-parallel rank's neighbours read the same pages)."""
    contents = check_gguf(path)
    model = build_meta_model(config, dtype, platform)
    tensors = _tensors(path, contents.tensors, contents.shape, platform, drop_file_pages and config.shard is None)
    try:
        with LoadProgress(len(contents.tensors), "GGUF weights", progress) as bar:
            loaded = _fill(model, tensors, config, dtype, platform, bar, int8, host_experts)
    finally:
        tensors.close()
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"{path}: no tensor for {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return model, contents.types


def load_gguf_prediction_layer(model: CausalLM, path: Path, dtype: torch.dtype, platform: Platform,
                               progress: bool, int8: bool, drop_file_pages: bool) -> set[str]:
    """Fill `model` (models/nextn.py's, on the meta device) from the file's block past the target's
    last, as llama.cpp's converter writes a multi-token-prediction layer: the decoder layer's tensors
    under their usual names, the rest under `nextn.`. Returns the parameter names filled (none: the
    file has no such block)."""
    config, index = model.config, model.config.num_hidden_layers
    contents = check_gguf(path)
    # Not its copies of the token table and head (the target's are read): nothing reads them ahead.
    infos = {name: info for name, info in contents.prediction_tensors.items()
             if layer_of(name) == index and model.gguf_checkpoint_name(name) is not None}
    if not infos:
        return set()
    tensors = _tensors(path, infos, contents.shape, platform, drop_file_pages)
    try:
        with LoadProgress(len(infos), "GGUF prediction layer", progress) as bar:
            return _fill(model, tensors, config, dtype, platform, bar, int8, None, layers={index: 0},
                         checkpoint_name=model.gguf_checkpoint_name)
    finally:
        tensors.close()


def _tensors(path: Path, infos: dict[str, TensorInfo], shape, platform: Platform, release: bool) -> _Tensors:
    permute = shape.gguf_arch in PERMUTED_QK_ARCHS
    return _Tensors(path, infos, {"attn_q": shape.heads, "attn_k": shape.kv_heads} if permute else {},
                    mapped=platform.reads_weights_in_place, release_copied=release)


def _fill(model: CausalLM, tensors: _Tensors, config: ModelConfig, dtype: torch.dtype, platform: Platform,
          bar: LoadProgress, int8: bool, host_experts: HostExperts | None, layers: dict[int, int] | None = None,
          checkpoint_name: Callable[[str], str | None] | None = None) -> set[str]:
    """Swap in quantized layers for what stays quantized, allocate the rest, load it; returns the
    parameter names filled (as CausalLM.load_weights does). `layers`: the file's blocks the model
    holds, as its layers (default: every layer of the config, the token table and head too);
    `checkpoint_name`: a float tensor's checkpoint name (None: not loaded), default hf_name's."""
    device, kernels = platform.device, platform.gguf
    shard = config.shard
    whole = layers is None
    layers = {i: i for i in range(config.num_hidden_layers)} if whole else layers
    checkpoint_name = checkpoint_name or (lambda name: hf_name(name, config.arch))

    def mine(name: str, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
        """This rank's part of tensor `name`'s rows, and its type."""
        if shard is None:
            return tensors.qtype(name), rows
        return _shard_rows(shard, name, hf_name(name, config.arch), rows, tensors.qtype(name))

    def laid_out(name: str, rows: torch.Tensor, in_features: int, int8_rows: bool) -> tuple[int, torch.Tensor]:
        qtype, part = mine(name, rows)
        return kernels.layout(qtype, part.to(device), in_features, int8_rows)

    consumed: set[str] = set()
    # A layer's parts that the file holds: Gemma 4's layers reading another's KV have no keys or values.
    groups = {f"model.layers.{local}.{ours}": [f"blk.{i}.{part}.weight" for part in parts
                                               if f"blk.{i}.{part}.weight" in tensors.infos]
              for i, local in layers.items() for ours, parts in fused_groups(config.arch).items()}
    if whole:
        groups["lm_head"] = ["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    else:  # a prediction layer's projection joining an embedding and a hidden state
        groups |= {"model.eh_proj": [f"blk.{i}.nextn.eh_proj.weight" for i in layers]}
    for ours, names in groups.items():
        if all(_FLOAT_DTYPES.get(tensors.qtype(n)) == dtype for n in names):
            continue  # already in the compute dtype: a plain (packable) nn.Linear, same bytes
        linear = model.get_submodule(ours)
        shared = ours == "lm_head" and config.tie_word_embeddings  # the token table reads these rows too
        parts = [tensors.laid_out(n, lambda rows, n=n: laid_out(n, rows, linear.in_features, int8 and not shared))
                 for n in names]
        _replace(model, ours, GGUFLinear(linear.in_features, parts, linear.bias, kernels, int8))
        consumed.update(names)
        bar.update(len(names))
    for layer, local in layers.items():
        names = [f"blk.{layer}.ffn_{part}_exps.weight" for part in ("gate", "up", "down")]
        if names[0] not in tensors.infos or all(_FLOAT_DTYPES.get(tensors.qtype(n)) == dtype for n in names):
            continue  # a dense layer, or experts in the compute dtype: loaded as float weights
        ours = f"model.layers.{local}.mlp.experts"
        dense = model.get_submodule(ours)
        hidden, width, count = config.hidden_size, dense.intermediate_size, dense.num_experts
        on_host = host_experts is not None and layer in host_experts.layers
        layer_kernels, layer_int8, ops = (kernels, int8, dense.ops)
        if on_host:  # the CPU platform's kernels, and its fused SiLU*mul where the GPU's would have run
            layer_kernels, layer_int8 = host_experts.platform.gguf, host_experts.int8
            ops = host_experts.platform.elementwise if dense.ops is not None else None

        def layout(name: str, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
            in_features = width if "down" in name else hidden
            if not on_host:
                return laid_out(name, rows, in_features, int8)
            qtype, part = mine(name, rows)
            return layer_kernels.layout(qtype, part, in_features, layer_int8)  # left in host memory

        # Gate and up as one matrix per expert where the file gives them one type (one kernel call).
        gate_up = ([names[:2]] if tensors.qtype(names[0]) == tensors.qtype(names[1]) else [names[:1], names[1:2]])
        _replace(model, ours, GGUFExperts(hidden, width, [tensors.experts_laid_out(part, count, layout)
                                                          for part in gate_up],
                                          tensors.experts_laid_out(names[2:], count, layout), layer_kernels,
                                          layer_int8, dense.act, ops, config.layout.experts))
        model.get_submodule(f"model.layers.{local}.mlp").host_experts = on_host
        consumed.update(names)
        bar.update(len(names))
    if whole:
        _quantized_tables(model, tensors, config, dtype, kernels, device, mine, consumed, bar)
    materialize(model, device)
    for layer in host_experts.layers if host_experts is not None else ():  # their biases too
        model.get_submodule(f"model.layers.{layer}.mlp.experts")._apply(lambda t: t.to("cpu"))
    if whole and config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight

    norm_offset = ARCHITECTURES[config.arch].gguf_norm_offset  # Gemma's norms are stored as 1 + w

    def float_weights():
        for name in tensors.infos:
            wanted = name not in consumed and name not in ROPE_TENSORS  # rope factors: read by the config
            checkpoint = checkpoint_name(name) if wanted else None
            if checkpoint is not None:
                tensor = tensors.floats(name, torch.float32)
                if norm_offset and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
                    tensor = tensor - norm_offset
                if name.endswith(".ssm_a"):  # llama.cpp keeps a linear-attention layer's -exp(A_log)
                    tensor = torch.log(-tensor)
                if name.endswith("ssm_conv1d.weight"):  # [channels, kernel]: a depthwise Conv1d's weight
                    tensor = tensor[:, None]
                if tensor.dim() == 1 and name.endswith("ffn_gate_inp_shexp.weight"):  # llama-quantize's [n]
                    tensor = tensor[None]  # the shared expert's gate: a [1, hidden] matrix
                yield checkpoint, tensor
            if name not in consumed:
                bar.update(1)

    return model.load_weights(float_weights())


def _quantized_tables(model: CausalLM, tensors: _Tensors, config: ModelConfig, dtype: torch.dtype, kernels,
                      device: torch.device, mine, consumed: set[str], bar: LoadProgress) -> None:
    """The token table (and Gemma 4's per-layer one) kept quantized where the file has them so."""
    embed_type = tensors.qtype("token_embd.weight")
    if _FLOAT_DTYPES.get(embed_type) != dtype:
        table = (model.lm_head.qweight_0 if config.tie_word_embeddings
                 # clone: this rank's rows alone, not a view keeping the whole table's copy alive
                 else mine("token_embd.weight", tensors.rows("token_embd.weight"))[1].clone().to(device))
        _replace(model, "model.embed_tokens", GGUFEmbedding(embed_type, table, config.hidden_size, dtype, kernels))
        if "token_embd.weight" not in consumed:
            consumed.add("token_embd.weight")
            bar.update(1)
    per_layer_table = "per_layer_token_embd.weight"  # Gemma 4's, looked up like the token table
    if per_layer_table in tensors.infos and _FLOAT_DTYPES.get(tensors.qtype(per_layer_table)) != dtype:
        width = tensors.infos[per_layer_table].dims[1]
        _replace(model, "model.embed_tokens_per_layer", GGUFEmbedding(
            tensors.qtype(per_layer_table), tensors.rows(per_layer_table).to(device), width, dtype, kernels))
        consumed.add(per_layer_table)
        bar.update(1)
