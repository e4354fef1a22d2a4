"""Gemma 4 (text): Gemma 3's sandwich block with plain (x * w) norms and attention scale 1, global
layers with their own head shape and proportional rope (their values the keys' projection where
attention_k_eq_v), values normalised without a scale, the last layers reading the KV cache of the last
earlier layer of their kind (projecting queries only), per-layer input embeddings added after each
MLP, and a learned scalar on each layer's output. The DecoderLayout carries the shapes; its
mixture-of-experts variant runs through the transformers backend (config.py).

The sharing layers write no cache, so a step computes them only for the rows it reads (each finished
prompt's last row and the decodes; ForwardContext.needed_rows), each as a decode over its sequence's
cache: a prompt's other rows stop at the last caching layer (vLLM's kv_sharing_fast_prefill)."""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, group_spans, paged_attention
from crane_mp.worker.models.layers import (
    ACTIVATIONS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GemmaRMSNorm,
    PagedSelfAttention,
    RMSNorm,
)
from crane_mp.worker.models.qwen3 import Qwen3Attention
from crane_mp.worker.models.rope import apply_rope
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import ForwardContext, forward_context, get_forward_context


class Gemma4SharedKVAttention(PagedSelfAttention):
    """A layer that projects queries only and attends over the keys and values that `kv_source`'s
    layer keeps in its cache (written there this step, before this layer runs); it writes none."""

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.fused = None
        self.fused_sizes = {"qkv_proj": [self.q_size]}
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, offset=0.0)
        self.kv_source: tuple[PagedSelfAttention, ...] = ()  # set by the model; a tuple, not a submodule

    def finalize_weights(self) -> None:
        """Nothing to stack: the query norm runs alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        (source,) = self.kv_source
        q = self.q_norm(self.qkv_proj(x).view(x.shape[0], self.num_heads, self.head_dim))
        q = apply_rope(q, *self._rope_rows(ctx))
        out = paged_attention(q, None, None, source.k_cache, source.v_cache, ctx.attn_of(source), self.scale,
                              self.window, self.softcap)
        return self.o_proj(out)


class Gemma4DecoderLayer(DecoderLayer):
    """The sandwich block, then the layer's per-layer input through a gate and a projection (added
    after its norm), then the layer's scalar."""

    def __init__(self, config: ModelConfig, attention: PagedSelfAttention, ops, norm_names=None, layer: int = 0):
        super().__init__(config, attention, ops, norm_names, layer)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        size = config.layout.per_layer_input_size
        if size:
            self.act = ACTIVATIONS[config.hidden_act]
            self.per_layer_input_gate = nn.Linear(config.hidden_size, size, bias=False)
            self.per_layer_projection = nn.Linear(size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        x = self._forward_other(x)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4TextModel(DecoderModel):
    layer_class = Gemma4DecoderLayer

    def __init__(self, config: ModelConfig, make_attention, platform: Platform, norm_names=None) -> None:
        layout = config.layout

        def attention(config: ModelConfig, platform: Platform, layer: int) -> PagedSelfAttention:
            shared = layout.kv_source(layer) != layer
            return (Gemma4SharedKVAttention if shared else make_attention)(config, platform, layer)

        super().__init__(config, attention, platform, norm_names)
        for layer, decoder_layer in enumerate(self.layers):
            if layout.kv_source(layer) != layer:
                decoder_layer.self_attn.kv_source = (self.layers[layout.kv_source(layer)].self_attn,)
        # The sharing layers are the last ones (num_kv_shared_layers): from here on no layer writes KV.
        sharing = [layer for layer in range(len(self.layers)) if layout.kv_source(layer) != layer]
        self.first_sharing = sharing[0] if sharing == list(range(len(self.layers) - len(sharing), len(self.layers))) \
            and sharing else len(self.layers)
        self.per_layer_input_size = size = layout.per_layer_input_size
        if size:
            rows, width = layout.per_layer_input_vocab, config.num_hidden_layers * size
            self.embed_tokens_per_layer = nn.Embedding(rows, width, _weight=torch.empty(rows, width))
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(size, config.rms_norm_eps, offset=0.0)
            self.projection_scale = config.hidden_size**-0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        per_layer = self._per_layer_inputs(input_ids, x) if self.per_layer_input_size else None
        for layer in range(self.first_sharing):
            x = self.layers[layer](x, per_layer[:, layer] if per_layer is not None else None)
        reading = self._reading_rows(x.shape[0]) if self.first_sharing < len(self.layers) else None
        if reading is None:
            return self._sharing_layers(x, per_layer)
        rows, ctx = reading
        if rows.numel() == 0:  # no row is read this step (prompt chunks only)
            return x
        with forward_context(ctx):
            read = self._sharing_layers(x.index_select(0, rows),
                                        per_layer.index_select(0, rows) if per_layer is not None else None)
        return x.index_copy(0, rows, read)

    def _sharing_layers(self, x: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        for layer in range(self.first_sharing, len(self.layers)):
            x = self.layers[layer](x, per_layer[:, layer] if per_layer is not None else None)
        return x

    def _reading_rows(self, num_rows: int) -> tuple[torch.Tensor, ForwardContext] | None:
        """The rows the step reads and a context that runs each as one decode over its sequence's cache,
        or None where every row is read (or the step does not say which)."""
        ctx = get_forward_context()
        needed = ctx.needed_rows
        if needed is None or ctx.spans is None or len(needed) == num_rows:
            return None
        wanted, ends, spans, end = set(needed), [], [], 0
        for span in ctx.spans:  # in row order; a read row is its sequence's last of the step
            end += span.q_len
            if end - 1 in wanted:
                ends.append(end - 1)
                spans.append(SeqSpan(span.ctx_before + span.q_len - 1, 1, span.block_table, span.group_tables))
        if ends != sorted(needed):
            return None
        rows = torch.tensor(ends, dtype=torch.long, device=ctx.cos.device)
        if not ends:
            return rows, ctx
        attn = ctx.attn

        def metadata(group_view: list[SeqSpan]):
            return build_metadata(group_view, [], attn.block_width, rows.device, attn.dtype, attn.backend)

        sliding = tuple(t.index_select(0, rows) for t in ctx.sliding_rope) if ctx.sliding_rope else None
        return rows, ForwardContext(
            metadata(spans), ctx.cos.index_select(0, rows), ctx.sin.index_select(0, rows), ctx.lora, spans,
            ctx.positions.index_select(0, rows) if ctx.positions is not None else None, sliding_rope=sliding,
            group_attn=[metadata(group_spans(spans, group)) for group in range(1, len(ctx.group_attn) + 1)])

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, size]: each token's own per-layer embedding (scaled by sqrt(size), rounded as
        the token embedding's scale is) with the normalised projection of its embedding."""
        shape = (x.shape[0], len(self.layers), self.per_layer_input_size)
        scale = torch.tensor(math.sqrt(self.per_layer_input_size), dtype=x.dtype)
        token = self.embed_tokens_per_layer(input_ids).view(shape) * scale
        context = (self.per_layer_model_projection(x) * self.projection_scale).view(shape)
        context = self.per_layer_projection_norm(context)
        return (context + token) * 2**-0.5


_MAPPED_TABLE = "model.embed_tokens_per_layer.weight"


class Gemma4ForCausalLM(CausalLM):
    """Also the language model of Gemma 4's multimodal checkpoints, served for text."""

    attention_class = Qwen3Attention  # its q/k norms multiply by w, before rope, at each layer's head size
    decoder_class = Gemma4TextModel
    renamed_weights = {"model.language_model.": "model."}
    ignored_weights = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        layout = config.layout
        # Checkpoints may hold the unused key/value weights of the layers that read others' KV.
        self.ignored_weights = (*type(self).ignored_weights, *(
            f"model.layers.{layer}.self_attn.{name}." for layer in range(config.num_hidden_layers)
            if layout.kv_source(layer) != layer for name in ("k_proj", "v_proj", "k_norm", "v_norm")))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As CausalLM's, but the per-layer embedding table (4.7 GB of E2B's 9.3 GB), which is only looked
        up, stays the checkpoint's own memory-mapped tensor where it is already in the model's dtype and
        device: its pages are read as tokens need them, never copied (as llama.cpp maps its file)."""
        table = getattr(self.model, "embed_tokens_per_layer", None)
        adopted = False

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal adopted
            for name, tensor in weights:
                mine = self.parameter_name(name) == _MAPPED_TABLE and isinstance(table, nn.Embedding)
                if mine and _same_kind(tensor, table.weight):
                    table.weight = nn.Parameter(tensor, requires_grad=False)
                    adopted = True
                else:
                    yield name, tensor

        loaded = super().load_weights(rest())
        return loaded | {_MAPPED_TABLE} if adopted else loaded

    def attention_layers(self) -> list[PagedSelfAttention]:
        """The layers that keep a KV cache (the sharing ones read theirs)."""
        return [layer.self_attn for layer in self.model.layers if not isinstance(layer.self_attn,
                                                                                  Gemma4SharedKVAttention)]


def _same_kind(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    return tensor.dtype == param.dtype and tensor.device == param.device and tensor.shape == param.shape
