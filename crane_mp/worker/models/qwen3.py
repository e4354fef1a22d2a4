"""Qwen3: Llama layout with a per-head RMSNorm on queries and keys, applied before rope (EXAONE 4's too)."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention, RMSNorm
from crane_mp.worker.platforms import Platform


class Qwen3Attention(PagedSelfAttention):
    qk_norm_position = "before_rope"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)  # the layer's own head size (Gemma 4)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm.weight, self.k_norm.weight


class Qwen3ForCausalLM(CausalLM):
    attention_class = Qwen3Attention
