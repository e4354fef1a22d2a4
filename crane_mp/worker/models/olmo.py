"""OLMo 2 and OLMo 3: norms after attention and after the MLP only, and RMSNorms over all of a token's
queries (and all of its keys) before they are split into heads; OLMo 3 adds sliding layers."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention, RMSNorm
from crane_mp.worker.platforms import Platform


class Olmo2Attention(PagedSelfAttention):
    qk_norm_position = "full_width"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)

    def full_width_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Olmo2ForCausalLM(CausalLM):
    attention_class = Olmo2Attention
