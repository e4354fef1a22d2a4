"""GGUF model files: find them, read their headers (gguf_header.py), check them, read their
hyper-parameters. Which architectures a file may declare: registry.py.

Every problem with a file becomes one GGUFFileError whose message names the file and what is wrong:
crane-launch checks a file before it starts any process (a bad file exits at once with that line),
and the worker and frontend raise the same messages. No torch here: the launcher imports this module.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from crane_mp.gguf_header import BigEndianFile, HeaderError, StringArray, read_header
from crane_mp.models.registry import (
    DENSE_MLP_NAMES,
    GGUF_ARCHITECTURES,
    GGUF_EXPERT_NAMES,
    GGUF_QK_NORM_NAMES,
    gguf_layer_names,
    gguf_optional_names,
    gguf_row,
)

# Types served (worker/quantized/formats.py and kernels/gguf_matmul.cpp); ggml's ids.
SERVED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 39: "MXFP4"}
FORMATS = ("auto", "safetensors", "gguf")


class GGUFFileError(ValueError):
    """The GGUF file cannot be served; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model lives: a safetensors directory, or one GGUF file (model_dir: the folder holding it)."""

    format: str
    model_dir: Path
    gguf_file: Path | None = None

    @property
    def path(self) -> Path:
        return self.gguf_file or self.model_dir


def resolve_model_source(path: str | Path, fmt: str = "auto") -> ModelSource:
    """--model-path and --format -> a ModelSource; raises GGUFFileError/FileNotFoundError with one line."""
    # absolute(), not resolve(): a hub cache's snapshots/<rev>/model.gguf is a link to blobs/<hash>,
    # and the link's own name and folder (tokenizer files beside it) are the ones that count.
    path = Path(path).absolute()
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}")
    if path.is_file():
        if fmt == "safetensors" or (fmt == "auto" and path.suffix.lower() != ".gguf"):
            raise FileNotFoundError(f"{path} is a file: give a model directory, or a .gguf file (--format gguf)")
        return ModelSource("gguf", path.parent, path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    ggufs = sorted(path.glob("*.gguf"))
    has_safetensors = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    if fmt == "safetensors" or (fmt == "auto" and has_safetensors):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return ModelSource("safetensors", path)
    if len(ggufs) == 1:
        return ModelSource("gguf", path, ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs[:4])
        raise FileNotFoundError(f"{path} holds several .gguf files ({names}): give one file as --model-path")
    if fmt == "gguf":
        raise FileNotFoundError(f"{path} holds no .gguf file")
    raise FileNotFoundError(f"{path} is not a model directory (no config.json with safetensors, no .gguf file)")


def _arch(meta: dict[str, Any], path: Path) -> str:
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise GGUFFileError(f"{path}: architecture {name!r} is not supported (supported: {supported})")
    return name


def _required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFFileError(f"{path}: metadata key {key} is missing")
    return meta[key]


@dataclass(frozen=True, slots=True)
class GGUFShape:
    """The hyper-parameters a GGUF file's metadata declares, in the file's own terms."""

    gguf_arch: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rms_eps: float
    rope_base: float
    rope_scaling: dict[str, Any]
    rope_dims: int = 0  # the leading dims of a head rope turns (partial rotary); 0: all of head_dim
    # Where layers differ (Gemma 4): per layer, whether it slides, its feed-forward width and KV heads;
    # the sliding layers' head size (head_dim is the global layers'); the per-layer input width and rows.
    sliding: tuple[bool, ...] = ()
    layer_ffn: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    head_dim_swa: int = 0
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # Mixtures of experts: experts per layer, how many a token uses, each one's width, the shared expert's.
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    dense_layers: int = 0  # the leading layers whose MLP is a dense one (DeepSeek's, GLM-4.5's)
    sigmoid_router: bool = False  # experts chosen by sigmoid scores (DeepSeek-V3's files, told from V2's)
    # Latent attention (DeepSeek): the latent's width, the query bottleneck's (0: none), a query head's
    # width and a value head's.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    mla_key_length: int = 0
    mla_value_length: int = 0
    # Linear-attention layers (Qwen3.5, Qwen3-Next; llama.cpp's ssm.* keys): key heads, value heads,
    # a key head's width, all value heads' width, the convolution's kernel; 0: none.
    ssm_key_heads: int = 0
    ssm_value_heads: int = 0
    ssm_key_dim: int = 0
    ssm_inner: int = 0
    ssm_conv_kernel: int = 0

    @property
    def row(self):
        """The registry row serving the file (Mixtral's files are "llama" files with experts, DeepSeek-V3's
        "deepseek2" files with a sigmoid router)."""
        return gguf_row(self.gguf_arch, self.experts > 0, self.sigmoid_router)

    def layer_dims(self, layer: int) -> tuple[int, int, int]:
        """(head size, KV heads, feed-forward width) of layer `layer`."""
        slides = bool(self.sliding) and self.sliding[layer]
        return (self.head_dim_swa if slides and self.head_dim_swa else self.head_dim,
                self.layer_kv_heads[layer] if self.layer_kv_heads else self.kv_heads,
                self.layer_ffn[layer] if self.layer_ffn else self.ffn)


# The longest context a GGUF file may declare: past any released model's (10M tokens).
MAX_CONTEXT = 1 << 24


def read_shape(meta: dict[str, Any], tensor_dims: dict[str, tuple[int, ...]], path: Path) -> GGUFShape:
    arch = _arch(meta, path)

    def key(name: str, default: Any = None) -> Any:
        full = f"{arch}.{name}"
        return meta.get(full, default) if default is not None else _required(meta, full, path)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    embd = tensor_dims.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size") or (embd[0] if embd else None)
    if vocab is None:
        raise GGUFFileError(f"{path}: no vocab_size and no token_embd.weight tensor")
    scaling: dict[str, Any] = {}
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "") and meta.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        scaling = {"rope_type": scaling_type, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
    # Per-layer lists where layers differ (Gemma 4); the scalar fields then hold the first layer's.
    ffn, kv_heads = key("feed_forward_length"), key("attention.head_count_kv", heads)
    layer_ffn = tuple(int(n) for n in ffn) if isinstance(ffn, list) else ()
    layer_kv = tuple(int(n) for n in kv_heads) if isinstance(kv_heads, list) else ()
    if 0 in layer_kv:  # llama.cpp's recurrent-layer mark; a layer holding keys has attention after all
        layer_kv = _kv_heads_from_keys(layer_kv, tensor_dims, int(key("attention.key_length", hidden // heads)))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    per_layer_table = tensor_dims.get("per_layer_token_embd.weight")
    experts = int(key("expert_count", 0))
    shape = GGUFShape(
        gguf_arch=arch,
        hidden=hidden,
        # Next-token-prediction layers (GLM-4.5's) come after the model's and are not served.
        layers=int(key("block_count")) - int(key("nextn_predict_layers", 0)),
        ffn=layer_ffn[0] if layer_ffn else int(ffn),
        heads=heads,
        kv_heads=layer_kv[0] if layer_kv else int(kv_heads),
        head_dim=int(key("attention.key_length", hidden // heads)),
        vocab=int(vocab),
        context=int(key("context_length", 2048)),
        # Cohere's LayerNorm has a plain epsilon.
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")
                      or key("attention.layer_norm_epsilon")),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_dims=int(key("rope.dimension_count", 0)),
        sliding=tuple(bool(flag) for flag in pattern) if isinstance(pattern, list) else (),
        layer_ffn=layer_ffn,
        layer_kv_heads=layer_kv,
        head_dim_swa=int(key("attention.key_length_swa", 0)),
        per_layer_input=int(key("embedding_length_per_layer_input", 0)),
        per_layer_vocab=per_layer_table[0] if per_layer_table else 0,
        experts=experts,
        experts_used=int(key("expert_used_count", 0)),
        expert_ffn=int(key("expert_feed_forward_length", 0)) or (layer_ffn[0] if layer_ffn else int(ffn)),
        shared_expert_ffn=int(key("expert_shared_feed_forward_length", 0))
        or int(key("expert_shared_count", 0)) * int(key("expert_feed_forward_length", 0)),
        dense_layers=int(key("leading_dense_block_count", 0)) if experts else 0,
        # llama.cpp's gating function 2 is the sigmoid; files that name none have it where they hold its bias.
        sigmoid_router=int(key("expert_gating_func", 0)) == 2 or any(name.endswith("exp_probs_b.bias")
                                                                     for name in tensor_dims),
        kv_lora_rank=int(key("attention.kv_lora_rank", 0)),
        q_lora_rank=int(key("attention.q_lora_rank", 0)),
        mla_key_length=int(key("attention.key_length_mla", 0)),
        mla_value_length=int(key("attention.value_length_mla", 0)),
        ssm_key_heads=int(key("ssm.group_count", 0)),
        ssm_value_heads=int(key("ssm.time_step_rank", 0)),
        ssm_key_dim=int(key("ssm.state_size", 0)),
        ssm_inner=int(key("ssm.inner_size", 0)),
        ssm_conv_kernel=int(key("ssm.conv_kernel", 0)),
    )
    if experts and not 0 < shape.experts_used <= experts:
        raise GGUFFileError(f"{path}: metadata gives {shape.experts_used} experts used of {experts}")
    for name in ("hidden", "layers", "ffn", "heads", "kv_heads", "head_dim", "vocab", "context"):
        if getattr(shape, name) <= 0:
            raise GGUFFileError(f"{path}: metadata gives {name} = {getattr(shape, name)}")
    if 0 in shape.layer_kv_heads:
        raise GGUFFileError(f"{path}: layer {shape.layer_kv_heads.index(0)} keeps recurrent state (no attention "
                            "tensors), which a paged KV cache cannot hold; hybrid models are not supported yet")
    for name in ("sliding", "layer_ffn", "layer_kv_heads"):
        values = getattr(shape, name)
        if values and (len(values) != shape.layers or (name != "sliding" and min(values) <= 0)):
            raise GGUFFileError(f"{path}: metadata gives {name} {list(values)} for {shape.layers} layers")
    # Bounded before anything is sized by them (a tiny file may claim a billion layers): every layer
    # needs its own tensors, and the longest context sizes tables at start-up.
    per_layer = min(len(required_layer_names(shape.row, sparse)) for sparse in (False, True))
    if shape.layers * per_layer + 2 > len(tensor_dims):
        raise GGUFFileError(f"{path}: metadata gives {shape.layers} layers, but the file holds {len(tensor_dims)} "
                            f"tensors ({per_layer} per layer needed)")
    if shape.context > MAX_CONTEXT:
        raise GGUFFileError(f"{path}: metadata gives a context of {shape.context} tokens (at most {MAX_CONTEXT})")
    return shape


def _kv_heads_from_keys(layer_kv: tuple[int, ...], tensor_dims: dict[str, tuple[int, ...]],
                        head_dim: int) -> tuple[int, ...]:
    """Per-layer KV heads where the metadata's 0 marks a recurrent layer but the layer holds attn_k:
    llama.cpp's converter writes a Granite 4 dense checkpoint whose config spells its layers
    "full_attention" (transformers 5) as all recurrent, its attention tensors intact. A layer
    without keys keeps its 0 (refused: recurrent layers are not served)."""
    keys = [tensor_dims.get(f"blk.{layer}.attn_k.weight") for layer in range(len(layer_kv))]
    return tuple(n or (dims[0] // head_dim if dims else 0) for n, dims in zip(layer_kv, keys))


def required_layer_names(row, sparse: bool = True) -> list[str]:
    """The per-layer tensors every layer of a file served by registry row `row` holds (q/k norms are
    the model's to ask for); `sparse` False: a leading dense layer of a mixture of experts, whose MLP is
    a dense one."""
    optional = gguf_optional_names(row)
    names = [name for name in gguf_layer_names(row.name) if name not in GGUF_QK_NORM_NAMES and name not in optional]
    if sparse or not row.experts:
        return names
    return [name for name in names if name not in GGUF_EXPERT_NAMES] + list(DENSE_MLP_NAMES)


def expected_shapes(shape: GGUFShape) -> dict[str, tuple[int, ...]]:
    """Tensor name -> numpy shape ([rows, cols]) the metadata implies; optional tensors included."""
    row = shape.row
    names = gguf_layer_names(row.name)
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (shape.vocab, shape.hidden),
        "output_norm.weight": (shape.hidden,),
        "output.weight": (shape.vocab, shape.hidden),
        "rope_freqs.weight": (shape.head_dim // 2,),
    }
    if names.get("attn_qkv") == "self_attn.qkv_proj":  # Phi-3: LongRoPE factors
        factors = ((shape.rope_dims or shape.head_dim) // 2,)
        shapes |= {"rope_factors_long.weight": factors, "rope_factors_short.weight": factors}
    if shape.per_layer_input:  # Gemma 4's per-layer inputs: one table and projection for all layers
        width = shape.layers * shape.per_layer_input
        shapes |= {"per_layer_token_embd.weight": (shape.per_layer_vocab, width),
                   "per_layer_model_proj.weight": (width, shape.hidden),
                   "per_layer_proj_norm.weight": (shape.per_layer_input,)}
    for layer in range(shape.layers):
        shapes.update({f"blk.{layer}.{name}": dims for name, dims in _layer_shapes(shape, layer, row, names).items()})
    return shapes


def _layer_shapes(shape: GGUFShape, layer: int, row, names: dict[str, str]) -> dict[str, tuple[int, ...]]:
    head_dim, kv_heads, ffn = shape.layer_dims(layer)
    hidden, q, kv = shape.hidden, shape.heads * head_dim, kv_heads * head_dim
    dims: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden), "attn_v.weight": (kv, hidden),
        "attn_output.weight": (hidden, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "attn_output.bias": (hidden,), "attn_q_norm.weight": (head_dim,),
        "attn_k_norm.weight": (head_dim,), "post_attention_norm.weight": (hidden,),
        "post_ffw_norm.weight": (hidden,), "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
        "ffn_gate.bias": (ffn,), "ffn_up.bias": (ffn,), "ffn_down.bias": (hidden,),
        "attn_sinks.weight": (shape.heads,),
    }
    if row.full_width_qk_norms:  # OLMo 2: one norm over all heads
        dims |= {"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)}
    if names.get("attn_qkv") == "self_attn.qkv_proj":  # Phi-3: fused q/k/v
        dims["attn_qkv.weight"] = (q + 2 * kv, hidden)
    if names.get("ffn_up") == "mlp.gate_up_proj":  # Phi-3, GLM-4: gate and up in one tensor
        dims["ffn_up.weight"] = (2 * ffn, hidden)
    if shape.per_layer_input:
        dims |= {"inp_gate.weight": (shape.per_layer_input, hidden), "proj.weight": (hidden, shape.per_layer_input),
                 "post_norm.weight": (hidden,)}
    if "layer_output_scale" in names:
        dims["layer_output_scale.weight"] = (1,)
    if shape.kv_lora_rank:  # latent attention
        heads, rank, rope = shape.heads, shape.kv_lora_rank, shape.rope_dims
        nope, query = shape.mla_key_length - rope, shape.heads * shape.mla_key_length
        dims |= {"attn_q.weight": (query, hidden), "attn_q_a.weight": (shape.q_lora_rank, hidden),
                 "attn_q_a_norm.weight": (shape.q_lora_rank,), "attn_q_b.weight": (query, shape.q_lora_rank),
                 "attn_kv_a_mqa.weight": (rank + rope, hidden), "attn_kv_a_norm.weight": (rank,),
                 "attn_k_b.weight": (heads, rank, nope), "attn_v_b.weight": (heads, shape.mla_value_length, rank),
                 "attn_output.weight": (hidden, heads * shape.mla_value_length)}
    if "ssm_conv1d" in names:  # a hybrid's layers: gated attention (query and gate) or linear attention
        values, conv = shape.ssm_value_heads, 2 * shape.ssm_key_heads * shape.ssm_key_dim + shape.ssm_inner
        dims |= {"attn_q.weight": (2 * q, hidden), "attn_qkv.weight": (conv, hidden),
                 "attn_gate.weight": (shape.ssm_inner, hidden), "ssm_conv1d.weight": (conv, shape.ssm_conv_kernel),
                 "ssm_a": (values,), "ssm_dt.bias": (values,), "ssm_norm.weight": (shape.ssm_inner // max(values, 1),),
                 "ssm_out.weight": (hidden, shape.ssm_inner), "ssm_beta.weight": (values, hidden),
                 "ssm_alpha.weight": (values, hidden), "ssm_ba.weight": (2 * values, hidden)}
    if shape.experts:
        experts, width, shared = shape.experts, shape.expert_ffn, shape.shared_expert_ffn
        dims |= {"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp.bias": (experts,),
                 "exp_probs_b.bias": (experts,),
                 "ffn_gate_exps.weight": (experts, width, hidden), "ffn_gate_exps.bias": (experts, width),
                 "ffn_up_exps.bias": (experts, width), "ffn_down_exps.bias": (experts, hidden),
                 "ffn_up_exps.weight": (experts, width, hidden), "ffn_down_exps.weight": (experts, hidden, width),
                 "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
                 "ffn_down_shexp.weight": (hidden, shared), "ffn_gate_inp_shexp.weight": (1, hidden)}
    return dims


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes lie in the file."""

    name: str
    qtype: int  # ggml type id
    dims: tuple[int, ...]  # numpy order: rows first
    offset: int  # absolute byte offset of its data
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFContents:
    shape: GGUFShape
    meta: dict[str, Any]  # scalar and string metadata (not the tokenizer arrays)
    types: Counter  # tensor type name -> count
    tensors: dict[str, TensorInfo]  # in file order
    # The blocks past the last (nextn_predict_layers): a multi-token-prediction layer's tensors.
    prediction_tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(info.n_bytes for info in self.tensors.values())


def check_gguf(path: Path) -> GGUFContents:
    """Open and validate a GGUF file without reading its tensor data (or its vocabulary: gguf_header.py).
    Raises GGUFFileError (one line) on anything we cannot serve. The result is kept per file (size,
    mtime), so a process reads a header once."""
    path = Path(path)
    stat = path.stat() if path.is_file() else None
    return _check(str(path), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1)


@lru_cache(maxsize=4)
def _check(name: str, size: int, mtime_ns: int) -> GGUFContents:
    from gguf import GGML_QUANT_SIZES

    path = Path(name)
    try:
        header = read_header(path)
    except BigEndianFile:
        raise GGUFFileError(f"{path}: a big-endian GGUF file; crane-mp serves little-endian files only") from None
    except (HeaderError, OSError) as err:
        raise GGUFFileError(f"{path}: not a readable GGUF file (truncated or corrupt?): {err}") from None
    # Scalars and strings, and short number arrays (a sliding-window pattern); not the tokenizer's.
    meta = {key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in header.metadata.items()
            if not isinstance(value, StringArray) and not (isinstance(value, np.ndarray) and value.size > 4096)}
    dims_of = {t.name: tuple(reversed(t.dims)) for t in header.tensors}  # ggml: fastest first
    shape = read_shape(meta, dims_of, path)
    expected = expected_shapes(shape)
    types: Counter = Counter()
    infos: dict[str, TensorInfo] = {}
    predicting: dict[str, TensorInfo] = {}
    for tensor in header.tensors:
        if layer_of(tensor.name) >= shape.layers:
            # A multi-token-prediction layer past the last: never the model's, kept aside for speculative
            # decoding where the file's types are ours (a tensor that is not is missed only by it).
            info = _prediction_tensor(tensor, dims_of[tensor.name], header.file_size)
            if info is not None:
                predicting[tensor.name] = info
            continue
        qtype = _tensor_type(tensor.type_id, path)
        dims = dims_of[tensor.name]
        want = expected.get(tensor.name)
        if want is None:
            raise GGUFFileError(f"{path}: unexpected tensor {tensor.name} for architecture {shape.gguf_arch}")
        if dims != want and not (want[0] == 1 and dims == want[1:]):  # a [1, n] matrix quantized as [n]
            raise GGUFFileError(f"{path}: tensor {tensor.name} has shape {list(dims)}, the metadata implies {list(want)}")
        if qtype not in SERVED_TYPES:
            supported = ", ".join(sorted(set(SERVED_TYPES.values())))
            raise GGUFFileError(
                f"{path}: tensor {tensor.name} has type {qtype.name}, which crane-mp cannot serve "
                f"(supported: {supported})"
            )
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_bytes = math.prod(dims) // block * block_bytes
        if tensor.offset + n_bytes > header.file_size:
            raise GGUFFileError(f"{path}: not a readable GGUF file (truncated or corrupt?): the data of tensor "
                                f"{tensor.name} runs past the end of the file")
        types[SERVED_TYPES[qtype]] += 1
        infos[tensor.name] = TensorInfo(tensor.name, int(qtype), dims, tensor.offset, n_bytes)
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{name}.weight" for i in range(shape.layers)
        for name in required_layer_names(shape.row, sparse=i >= shape.dense_layers)
    ]
    missing = [name for name in required if name not in infos]
    if missing:
        raise GGUFFileError(f"{path}: {len(missing)} required tensors are missing, e.g. {missing[0]}")
    return GGUFContents(shape, meta, types, infos, predicting)


def layer_of(name: str) -> int:
    """The block a tensor name is in (blk.N.*); -1 for the model's global tensors."""
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1


def _prediction_tensor(tensor, dims: tuple[int, ...], file_size: int) -> TensorInfo | None:
    """A tensor of a block past the last, where its type is one we serve and its data is in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(tensor.type_id)
    except ValueError:
        return None
    if qtype not in SERVED_TYPES:
        return None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_bytes = math.prod(dims) // block * block_bytes
    if tensor.offset + n_bytes > file_size:
        return None
    return TensorInfo(tensor.name, int(qtype), dims, tensor.offset, n_bytes)


def _tensor_type(type_id: int, path: Path):
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        raise GGUFFileError(
            f"{path}: a tensor has type id {type_id}, which is no GGML type crane-mp knows "
            f"(supported: {', '.join(sorted(set(SERVED_TYPES.values())))})"
        ) from None


# Tensors the config reads (rope factors), not model weights.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's
ROPE_TENSORS = ("rope_freqs.weight", *LONGROPE_TENSORS)


def rope_freq_factors(path: Path, infos: dict[str, TensorInfo], name: str = "rope_freqs.weight") -> list[float]:
    """A rope factor tensor (F32): Llama 3's per-frequency divisors (rope_freqs), Phi-3's LongRoPE factors."""
    info = infos[name]
    if SERVED_TYPES[info.qtype] != "F32":
        raise ValueError(f"{path}: {name} must be F32")
    with open(path, "rb") as file:
        file.seek(info.offset)
        return np.frombuffer(file.read(info.n_bytes), dtype="<f4").astype(float).tolist()


def describe_types(types: Counter) -> str:
    """'Q4_K x 169, Q6_K x 29, F32 x 57', most common first."""
    return ", ".join(f"{name} x {count}" for name, count in types.most_common())
