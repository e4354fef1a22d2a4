"""Hunyuan dense (transformers' hunyuan_v1_dense): Llama layout with per-head query/key RMSNorm after rope."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention, RMSNorm
from crane_mp.worker.platforms import Platform


class HunYuanDenseAttention(PagedSelfAttention):
    qk_norm_position = "after_rope"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.query_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_layernorm.weight, self.key_layernorm.weight


class HunYuanDenseForCausalLM(CausalLM):
    attention_class = HunYuanDenseAttention
