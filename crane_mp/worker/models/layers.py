"""Building blocks shared by the Llama-family models: RMSNorm, gated MLP, paged self-attention, packed loading.

Float32 numerics follow transformers' reference closely; in 16-bit we prefer fused ops over
reproducing its intermediate roundings. Norms, SiLU*mul and q/k norm + rope + KV write run as the
platform's fused kernels where it has them (the C++ ops on CPU, Triton on CUDA), handed to each layer
when it is built.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.models.sharding import Shard
from crane_mp.worker.cache.attention import paged_attention
from crane_mp.worker.models.checkpoint import fill
from crane_mp.worker.models.moe import EXPERT_PROJECTIONS, RoutedExperts, SparseMoE
from crane_mp.worker.models.rope import apply_rope
from crane_mp.worker.parallel.tensor_parallel import all_reduce, gather_columns
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Any = None) -> None:
        """`ops`: the platform's fused kernels (Platform.elementwise), None for torch ops."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: adds x to it first and returns (norm(residual + x), residual + x).

        The fused CPU kernel updates both tensors in place, so callers pass tensors they own."""
        ops = self.ops
        if residual is None:
            if ops is not None:
                return ops.rms_norm(x.contiguous(), self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if ops is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * (1 + w), computed in float32 and rounded once (the checkpoint holds w);
    `offset` 0: x * w (Gemma 4's)."""

    def __init__(self, size: int, eps: float, offset: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.offset = offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual` (a "pre" block, Qwen3.5): (norm(residual + x), residual + x)."""
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


class WeightOnlyLayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, scaled by a weight and no bias, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps).to(x.dtype)


def make_norm(size: int, eps: float, kind: str, ops: Any = None) -> nn.Module:
    """The norm a family's DecoderLayout names ("rms", "gemma" or "layer")."""
    if kind == "gemma":
        return GemmaRMSNorm(size, eps)
    if kind == "layer":
        return WeightOnlyLayerNorm(size, eps)
    return RMSNorm(size, eps, ops)


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any = None, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: this layer's width where it is not the config's."""
        super().__init__()
        self.ops = ops
        self.row_parallel = config.shard is not None  # down_proj's output is this rank's part of a sum
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        # The checkpoint tensors gate_up_proj packs: their rows, in order (CausalLM.load_weights).
        self.fused_sizes = {"gate_up_proj": [self.intermediate_size, self.intermediate_size]}
        self.act = ACTIVATIONS[config.hidden_act]
        if self.act is F.silu:  # SiLU*mul may run inside down_proj (kernels/skinny_linears.py)
            self.down_proj.prologue = "silu_mul"
        # LoRA adapters: id -> (A, B) per projection (worker/weights/lora.py); empty without adapters.
        self.lora_gate_up_proj: dict = {}
        self.lora_down_proj: dict = {}

    def forward(self, x: torch.Tensor | None, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """`gate_up`: the gate/up projection of the layer's input, where the layer computed it (x None)."""
        lora = get_forward_context().lora
        hidden = None
        if gate_up is None and getattr(self.gate_up_proj, "silu_mul", False):  # packed with SiLU*mul in its
            hidden = self.gate_up_proj(x)  # epilogue (cpu_packing.py); never so when adapters may adapt gate_up
        elif gate_up is None and self.act is F.silu and self.ops is not None and not (
                lora is not None and self.lora_gate_up_proj):
            fused = getattr(self.gate_up_proj, "silu_mul_of", None)  # GGUF parts: SiLU*mul inside the kernel call
            hidden = None if fused is None else fused(x)
        if hidden is None:
            if gate_up is None:
                gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
                if lora is not None and self.lora_gate_up_proj:
                    gate_up = lora.apply(x, gate_up, self.lora_gate_up_proj)
            folded = getattr(self.down_proj, "after_silu_mul", None)
            out = folded(gate_up) if folded is not None and lora is None else None
            if out is not None:
                return all_reduce(out) if self.row_parallel else out
            if self.act is F.silu and self.ops is not None:
                hidden = self.ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                hidden = self.act(gate) * up
        out = self.down_proj(hidden)
        if lora is not None and self.lora_down_proj:
            out = lora.apply(hidden, out, self.lora_down_proj)
        return all_reduce(out) if self.row_parallel else out


def make_mlp(config: ModelConfig, ops: Any, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a gated one, or a mixture of experts where the layout has them there."""
    layout = config.layout
    if not layout.sparse(layer):
        return GatedMLP(config, ops, layout.intermediate_size(layer, config.intermediate_size))
    experts = layout.experts
    shared = GatedMLP(config, ops, experts.shared_intermediate_size) if experts.shared_intermediate_size else None
    return SparseMoE(config.hidden_size, experts, ACTIVATIONS[config.hidden_act], ops, shared)


_QK_NORM_CODES = {None: 0, "before_rope": 1, "after_rope": 2}  # qkv_rope_cache's qk_norm_position


class PagedSelfAttention(nn.Module):
    """Fused QKV projection, rope on queries and keys together, paged attention, output projection.

    Subclasses with per-head query/key norms set `qk_norm_position` and provide `qk_norm_weights()`;
    "full_width" norms all of the queries (and all of the keys) of a token as one vector (OLMo 2).
    Layer `layer`'s window, rope (its table, or none) and soft-cap come from the config's DecoderLayout.
    """

    qk_norm_position: str | None = None  # "before_rope" (Qwen3), "after_rope" (Hunyuan) or "full_width"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0, qkv_bias: bool | None = None,
                 o_bias: bool | None = None) -> None:
        super().__init__()
        layout = config.layout
        self.window = layout.window(layer, config.sliding_window)
        self.rope = layout.rope_kind(layer)  # "global", "sliding" or None
        self.interleaved = layout.rope_interleaved
        self.softcap = layout.attn_softcap
        # q/k norm, rope and the KV-cache write in one pass over qkv, where the platform has that kernel
        # and the layer's rope is the whole head's, turning halves.
        plain_rope = self.rope is not None and layout.rotary_dim is None and not self.interleaved
        fusable = plain_rope and self.qk_norm_position != "full_width" and platform.fused_qkv(config.head_dim)
        self.fused = platform.elementwise if fusable else None
        self.row_parallel = config.shard is not None  # o_proj's output is this rank's part of a sum
        self.num_heads = config.num_attention_heads
        self.head_dim, self.num_kv_heads = layout.head_shape(layer, config.head_dim, config.num_key_value_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Gemma 4: a global layer's values are its keys' projection; values are normalised (no scale).
        self.values_are_keys = layout.values_are_keys and layout.is_global(layer)
        self.value_norm = layout.value_norm
        self.scale = layout.attention_scale or self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        qkv_bias = config.attention_bias if qkv_bias is None else qkv_bias
        if o_bias is None:
            o_bias = config.attention_bias if layout.attention_out_bias is None else layout.attention_out_bias
        # The checkpoint tensors qkv_proj packs: their rows, in order (CausalLM.load_weights).
        self.fused_sizes = {"qkv_proj": [self.q_size, self.kv_size] + ([] if self.values_are_keys else [self.kv_size])}
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.fused_sizes["qkv_proj"]), bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        # gpt-oss: each query head's sink logit (DecoderLayout.attention_sinks), this rank's heads.
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if layout.attention_sinks \
            else None
        self.k_cache: torch.Tensor | None = None  # bound by the runner: [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # which KV group's block tables the layer reads (set by the runner)
        self.qk_norm_weight: torch.Tensor | None = None  # [heads + kv_heads, head_dim], see finalize_weights
        self.lora_qkv_proj: dict = {}  # LoRA adapters: id -> (A, B) (worker/weights/lora.py)
        self.lora_o_proj: dict = {}

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def finalize_weights(self) -> None:
        """After loading: stack the query and key norm weights so one op normalises both."""
        if self.qk_norm_position in ("before_rope", "after_rope"):
            q_weight, k_weight = self.qk_norm_weights()
            self.qk_norm_weight = torch.cat(
                [q_weight.expand(self.num_heads, -1), k_weight.expand(self.num_kv_heads, -1)]
            )

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(qk, (self.head_dim,), None, self.eps) * self.qk_norm_weight

    def forward(self, x: torch.Tensor | None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """`qkv`: the projection of the layer's input, where the layer computed it (x None)."""
        ctx = get_forward_context()
        if qkv is None:
            qkv = self.qkv_proj(x)  # [T, (H + 2 * KH) * D]
            if ctx.lora is not None and self.lora_qkv_proj:
                qkv = ctx.lora.apply(x, qkv, self.lora_qkv_proj)
        if self.values_are_keys or self.value_norm:
            qkv = self._with_values(qkv)
        if self.fused is not None:
            cos, sin = self._rope_rows(ctx)
            meta = ctx.attn_of(self)
            q = self.fused.qkv_rope_cache(
                qkv, cos, sin, self.qk_norm_weight, _QK_NORM_CODES[self.qk_norm_position], self.eps,
                meta.slot_mapping, self.k_cache, self.v_cache, self.num_heads,
            )
            out = paged_attention(q, None, None, self.k_cache, self.v_cache, meta, self.scale, self.window,
                                  self.softcap, self.sinks)
        else:
            out = self._attend_unfused(qkv, ctx)
        projected = self.o_proj(out)
        if ctx.lora is not None and self.lora_o_proj:
            projected = ctx.lora.apply(out, projected, self.lora_o_proj)
        return all_reduce(projected) if self.row_parallel else projected

    def _with_values(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with the values the cache keeps: the keys' projection where the layer has no values of
        its own, normalised per head without a scale (value_norm)."""
        num_tokens, values_at = qkv.shape[0], self.q_size + self.kv_size
        v = qkv[:, self.q_size : values_at] if self.values_are_keys else qkv[:, values_at:]
        if self.value_norm:
            heads = v.reshape(num_tokens, self.num_kv_heads, self.head_dim).float()
            v = F.rms_norm(heads, (self.head_dim,), None, self.eps).to(qkv.dtype).view(num_tokens, self.kv_size)
        if self.values_are_keys:
            return torch.cat([qkv, v], dim=1)
        qkv[:, values_at:] = v
        return qkv

    def _rope_rows(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return ctx.sliding_rope if self.rope == "sliding" else (ctx.cos, ctx.sin)

    def full_width_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _attend_unfused(self, qkv: torch.Tensor, ctx) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        if self.qk_norm_position == "full_width":
            q, k = self.full_width_qk_norm(qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size])
            qk = torch.cat([q, k], dim=1).view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                           self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        if self.qk_norm_position == "before_rope":
            qk = self._qk_norm(qk)
        if self.rope is not None:
            qk = apply_rope(qk, *self._rope_rows(ctx), self.interleaved)  # [T, H + KH, D]
        if self.qk_norm_position == "after_rope":
            qk = self._qk_norm(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, ctx.attn_of(self), self.scale, self.window,
                               self.softcap, self.sinks)  # [T, H * D]


# The norms of each block kind, in the order the block applies them (DecoderLayout.block); a family
# naming them otherwise sets CausalLM.norm_names (GLM-4).
BLOCK_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "parallel": ("input_layernorm",),
}


def _after_norm(proj: nn.Module | None, x: torch.Tensor, residual: torch.Tensor | None,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(proj(norm(x + residual)), x + residual) from one kernel where the projection computes its input
    (decode rows on CUDA, kernels/skinny_linears.py); None where the norm runs on its own."""
    after_norm = getattr(proj, "after_norm", None)
    return None if after_norm is None else after_norm(x, residual, norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: PagedSelfAttention, ops: Any,
                 norm_names: tuple[str, ...] | None = None, layer: int = 0) -> None:
        super().__init__()
        layout = config.layout
        self.block = layout.block
        self.residual_scale = layout.residual_scale
        self.norm_names = norm_names or BLOCK_NORMS[self.block]
        fused_ops = ops if layout.norm == "rms" else None
        for name in self.norm_names:
            setattr(self, name, make_norm(config.hidden_size, config.rms_norm_eps, layout.norm, fused_ops))
        self.self_attn = attention
        self.mlp = make_mlp(config, ops, layer)
        if self.block == "pre" and layout.norm == "rms":  # each norm may run inside the projection after it
            for proj in (getattr(attention, "qkv_proj", None), getattr(self.mlp, "gate_up_proj", None)):
                if type(proj) is nn.Linear:
                    proj.prologue = "rms"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A "pre" block returns (this layer's MLP output, the residual stream before it); their sum is
        the layer's output. Passing them apart lets the next layer fuse the residual add into its first
        norm. The other blocks return (the layer's output, None)."""
        if self.block != "pre":
            return self._forward_other(x), None
        input_norm, post_attention_norm = (getattr(self, name) for name in self.norm_names)
        adapted = get_forward_context().lora is not None  # adapters read each projection's own input
        folded = None if adapted else _after_norm(getattr(self.self_attn, "qkv_proj", None), x, residual, input_norm)
        if folded is not None:
            qkv, residual = folded
            x = self.self_attn(None, qkv=qkv)
        else:
            if residual is None:
                residual, x = x, input_norm(x)
            else:
                x, residual = input_norm(x, residual)
            x = self.self_attn(x)
        if self.residual_scale != 1.0:
            x = x * self.residual_scale
        folded = None if adapted else _after_norm(getattr(self.mlp, "gate_up_proj", None), x, residual,
                                                  post_attention_norm)
        if folded is not None:
            gate_up, residual = folded
            x = self.mlp(None, gate_up=gate_up)
        else:
            x, residual = post_attention_norm(x, residual)
            x = self.mlp(x)
        return (x * self.residual_scale if self.residual_scale != 1.0 else x), residual

    def _forward_other(self, x: torch.Tensor) -> torch.Tensor:
        norms = [getattr(self, name) for name in self.norm_names]
        if self.block == "sandwich":
            x = x + norms[1](self.self_attn(norms[0](x)))
            return x + norms[3](self.mlp(norms[2](x)))
        if self.block == "post":
            x = x + norms[0](self.self_attn(x))
            return x + norms[1](self.mlp(x))
        normed = norms[0](x)  # parallel
        return x + self.self_attn(normed) + self.mlp(normed)


class DecoderModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, make_attention, platform: Platform,
                 norm_names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.shard = config.shard
        rows = config.vocab_size if config.shard is None else config.shard.vocab_rows
        # Given its weight, nn.Embedding skips its random init (1.5-2 s of torch's init path, even on meta).
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.embedding_scale = config.layout.embedding_scale
        # Gemma rounds its sqrt(hidden) scale to the model dtype before multiplying; Granite does not.
        self.round_embedding_scale = config.layout.round_embedding_scale
        self.layers = nn.ModuleList(
            self.layer_class(config, make_attention(config, platform, layer), platform.elementwise, norm_names, layer)
            for layer in range(config.num_hidden_layers))
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps, config.layout.norm, platform.elementwise)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Returns the last layer's output before the final norm, which compute_logits applies to the
        few rows that need logits."""
        x = self.embed(input_ids)  # [T, hidden]
        ctx = get_forward_context()
        if ctx.embeds is not None:  # an image's placeholders take its vision embeddings
            rows, values = ctx.embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        deepstack = ctx.deepstack or ()
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual)
            if i < len(deepstack):  # the layer's output (summed as transformers does), plus the image rows'
                x = (x if residual is None else x + residual).index_add(0, ctx.embeds[0], deepstack[i].to(x.dtype))
                residual = None
        return x if residual is None else x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(input_ids)
        if self.embedding_scale == 1.0:
            return x
        if self.round_embedding_scale:
            return x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        return x * self.embedding_scale

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the ids in its rows (zeros for the others'), then the sum.
        start, stop = self.shard.vocab
        local = input_ids - start
        outside = (input_ids < start) | (input_ids >= stop)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return all_reduce(x.masked_fill_(outside[:, None], 0))


def shard_tensor(shard: Shard, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (sharding.py says which)."""
    split = shard.split(name)
    if split is None:
        return tensor
    if split.zero:
        return torch.zeros_like(tensor)
    part = tensor.narrow(split.axis, split.start, split.stop - split.start)
    if split.rows > part.shape[0]:
        part = torch.cat([part, part.new_zeros(split.rows - part.shape[0], *part.shape[1:])])
    return part


def _layer_index(name: str) -> int:
    """The decoder layer a parameter name is under; -1 for none."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


# A per-expert checkpoint tensor: (the experts module, the expert or none for all of them, its projection).
_EXPERT_WEIGHT = re.compile(rf"(.+\.experts)(?:\.(\d+))?\.({'|'.join(EXPERT_PROJECTIONS)})\.(weight|bias)")

# HF checkpoint names that we store packed into one fused parameter: name -> (fused name, shard index).
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # A Gated DeltaNet layer's input projections (Qwen3.5's names).
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
    "in_proj_ba": ("in_proj", 2),  # Qwen3-Next's b and a in one
}


class CausalLM(nn.Module):
    """Model + LM head. Subclasses pick the attention class; checkpoint names are Hugging Face's."""

    attention_class: type[PagedSelfAttention] = PagedSelfAttention
    # Checkpoint-name fragments renamed to ours before loading (e.g. Hunyuan's query_layernorm).
    renamed_weights: dict[str, str] = {}
    norm_names: tuple[str, ...] | None = None  # a layer's norms, where not BLOCK_NORMS' names
    ignored_weights: tuple[str, ...] = ()  # checkpoint-name prefixes (ours) of parts not served (a vision tower)
    skips_extra_layers = False  # layers past the config's (a multi-token-prediction head) are not served
    prediction_layer: str | None = None  # how the checkpoint keeps a multi-token-prediction layer (nextn.py)
    decoder_class: type[DecoderModel] = DecoderModel

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_class(config, self.attention_class, platform, self.norm_names)
        rows = config.vocab_size if config.shard is None else config.shard.vocab_rows
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        # Each rank's logits are a slice of the vocabulary, gathered whole (False for a stub head).
        self.vocab_parallel = config.shard is not None
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """The head reads the embedding's rows (again after the meta-device model is materialised)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def compute_dtype(self) -> torch.dtype:
        """What hidden states are computed in (the final norm's: a GGUF model's matrices are quantized)."""
        return self.model.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T]; returns hidden states [T, hidden] (final norm not yet applied)."""
        return self.model(input_ids)

    @property
    def logits_size(self) -> int:
        """The width of compute_logits' rows: the vocabulary (1 for an embedding model's stub head)."""
        return self.config.vocab_size if self.vocab_parallel else self.lm_head.out_features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] rows of forward()'s output -> logits [N, vocab]."""
        return self.head_logits(self.model.norm(hidden))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of rows already through a final norm (the model's, or a prediction layer's)."""
        logits = self.lm_head(normed)
        if self.vocab_parallel:
            logits = gather_columns(logits, self.config.vocab_size)
        layout = self.config.layout
        if layout.logit_scale != 1.0:
            logits = logits * layout.logit_scale
        if layout.final_softcap:  # in float32: tanh flattens 16-bit logits into ties
            logits = torch.tanh(logits.float() / layout.final_softcap) * layout.final_softcap
        return logits

    def attention_layers(self) -> list[PagedSelfAttention]:
        """The layers' attention modules, which keep a KV cache (a hybrid's recurrent layers do not)."""
        return [layer.self_attn for layer in self.model.layers if not getattr(layer.self_attn, "recurrent", False)]

    def state_layers(self) -> list[nn.Module]:
        """The layers' token mixers that keep recurrent state per sequence (worker/cache/state_pool.py)."""
        return [layer.self_attn for layer in self.model.layers if getattr(layer.self_attn, "recurrent", False)]

    def parameter_name(self, checkpoint_name: str) -> str:
        """A checkpoint tensor's name as ours: renamed_weights applied, under `model.`."""
        for old, new in self.renamed_weights.items():
            checkpoint_name = checkpoint_name.replace(old, new)
        if not checkpoint_name.startswith(("model.", "lm_head.")):
            return "model." + checkpoint_name  # a bare decoder's checkpoint (e.g. saved as Qwen3Model for embeddings)
        return checkpoint_name

    def _fused_sizes(self, param_name: str) -> list[int] | None:
        """The rows of the checkpoint tensors a fused parameter packs, in order (None: not fused)."""
        parts = param_name.rsplit(".", 2)
        if len(parts) < 3:
            return None
        return getattr(self.get_submodule(parts[0]), "fused_sizes", {}).get(parts[1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into our (possibly packed) parameters; returns the parameter names filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith("score."):
                continue  # score.*: a classification head, which the frontend applies (--task score)
            name = self.parameter_name(name)
            if name.startswith(self.ignored_weights) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if self.skips_extra_layers and _layer_index(name) >= self.config.num_hidden_layers:
                continue
            if self.config.shard is not None:
                tensor = shard_tensor(self.config.shard, name, tensor)
            expert = _EXPERT_WEIGHT.fullmatch(name)
            if expert is not None:  # one expert's projection, or every expert's (GGUF), into the stacked experts
                module, index, projection, kind = expert.groups()
                experts = self.get_submodule(module)
                if kind == "bias":
                    parts = experts.load_bias(projection, tensor, name)
                elif index is not None:
                    parts = [experts.load_expert(int(index), projection, tensor, name)]
                else:
                    parts = experts.load_stacked(projection, tensor, name)
                loaded.update(f"{module}.{part}" for part in parts)
                continue
            parts = name.split(".")
            # A parameter of the name's own (DeepSeek's unfused q_proj) is filled as it is.
            packed = PACKED_WEIGHTS.get(parts[-2]) if len(parts) >= 2 and name not in params else None
            if name in params and self._fused_sizes(name):  # a checkpoint that fuses them too (Phi-3, GLM-4)
                fill(params[name].data, tensor, name)
                loaded.update(f"{name}#{i}" for i in range(len(self._fused_sizes(name))))
                continue
            if packed is not None:
                fused, shard = packed
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                sizes = self._fused_sizes(target) if target in params else None
                if sizes is None or shard >= len(sizes):
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
                start = sum(sizes[:shard])
                fill(params[target].data[start : start + sizes[shard]], tensor, name)
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            fill(params[name].data, tensor, name)
            loaded.add(name)
        for layer in self.model.layers:
            layer.self_attn.finalize_weights()
        for prefix, module in self.named_modules():
            if isinstance(module, RoutedExperts):  # a stacked parameter loaded in parts is loaded whole
                for param in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
                    parts = {f"{prefix}.{part}" for part in module.expected_parts(param)}
                    if parts and parts <= loaded:  # none: a parameter these experts do not have
                        loaded.add(f"{prefix}.{param}")
        return loaded

    def expected_weights(self) -> set[str]:
        """The names `load_weights` must fill for the model to be complete."""
        expected = set()
        for name, _ in self.named_parameters():
            sizes = self._fused_sizes(name)
            if sizes:
                expected.update(f"{name}#{i}" for i in range(len(sizes)))
            else:
                expected.add(name)
        return expected
