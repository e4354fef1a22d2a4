"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers (gated_deltanet.py) between gated
attention layers, as the config's layer_types lists them.

The attention layers are Qwen3's (per-head q/k norms before rope, here (1 + w) norms) with rope on a
quarter of each head and an output gate: the query projection makes each head's query and gate side
by side (the checkpoint's and llama.cpp's layout, kept in the fused QKV projection), and the head's
output is scaled by sigmoid(gate) before o_proj. A qwen3_5 / qwen3_5_moe checkpoint
with a vision tower is served for text; the multi-token-prediction layer the released checkpoints carry
(`mtp.*`) is a model of its own (nextn.py), loaded for --speculative-method mtp.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.gated_deltanet import GatedDeltaNet
from crane_mp.worker.models.layers import CausalLM, DecoderModel, GemmaRMSNorm, PagedSelfAttention
from crane_mp.worker.models.nextn import MTP_PREFIXES
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context


class GatedAttention(PagedSelfAttention):
    qk_norm_position = "before_rope"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.fused = None  # the fused kernel takes [q, k, v] rows alone
        self.fused_sizes = {"qkv_proj": [2 * self.q_size, self.kv_size, self.kv_size]}
        bias = self.qkv_proj.bias is not None
        self.qkv_proj = torch.nn.Linear(config.hidden_size, sum(self.fused_sizes["qkv_proj"]), bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return 1.0 + self.q_norm.weight, 1.0 + self.k_norm.weight

    def forward(self, x: torch.Tensor | None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        projected = self.qkv_proj(x) if qkv is None else qkv
        rows = projected.shape[0]
        heads = projected[:, : 2 * self.q_size].view(rows, self.num_heads, 2, self.head_dim)
        queries = heads[:, :, 0].reshape(rows, self.q_size)
        out = self._attend_unfused(torch.cat([queries, projected[:, 2 * self.q_size :]], dim=1), ctx)
        return self.o_proj(out * torch.sigmoid(heads[:, :, 1].reshape(rows, self.q_size)))


class HybridDecoderModel(DecoderModel):
    """Each layer's token mixer a Gated DeltaNet or attention, as layer_types says."""

    def __init__(self, config: ModelConfig, make_attention, platform: Platform,
                 norm_names: tuple[str, ...] | None = None) -> None:
        def mixer(config: ModelConfig, platform: Platform, layer: int) -> nn.Module:
            if config.layout.is_linear(layer):
                return GatedDeltaNet(config, platform.elementwise)
            return make_attention(config, platform, layer)

        super().__init__(config, mixer, platform, norm_names)


class Qwen35ForCausalLM(CausalLM):
    attention_class = GatedAttention
    decoder_class = HybridDecoderModel
    # The layers' mixers sit under `self_attn` whatever their kind; transformers 5's names of the
    # vision-language checkpoints' language model (model.language_model.*) are the text model's.
    renamed_weights = {".linear_attn.": ".self_attn.", "model.language_model.": "model."}
    ignored_weights = ("model.visual.",)
    prediction_layer = "mtp"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._as_ours(weights))

    def _as_ours(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors as our parameters take them; the multi-token-prediction layer's are left to
        its own model (nextn.py, when speculating)."""
        for name, tensor in weights:
            if not name.startswith(MTP_PREFIXES):
                yield from self._split_linear(name, tensor)

    def _split_linear(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield name, tensor


class Qwen3NextForCausalLM(Qwen35ForCausalLM):
    """Qwen3-Next: Qwen3.5's layers, but its Gated DeltaNet projections are two matrices whose rows are
    grouped by key head ([queries, keys, values, gates] of each, and [b, a] of each): the first is
    re-laid out here as Qwen3.5's in_proj_qkv and in_proj_z (llama.cpp's files hold them so), the second
    kept (the layer reads it grouped)."""

    def _split_linear(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        linear = self.config.layout.linear
        heads, ratio = linear.key_heads, linear.value_heads // linear.key_heads
        if name.endswith(".in_proj_qkvz.weight"):
            stem = name[: -len("in_proj_qkvz.weight")]
            sizes = [linear.key_dim, linear.key_dim, ratio * linear.value_dim, ratio * linear.value_dim]
            q, k, v, z = (part.reshape(-1, tensor.shape[-1]) for part in
                          tensor.reshape(heads, sum(sizes), -1).split(sizes, dim=1))
            yield stem + "in_proj_qkv.weight", torch.cat([q, k, v])
            yield stem + "in_proj_z.weight", z
        else:
            yield name, tensor
