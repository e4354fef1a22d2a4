"""GLM-4 (0414): Llama's attention with q/k/v biases and rope on the first half of each head in
interleaved pairs, four norms per layer under its own names, and a checkpoint that fuses gate and up.
GLM-4.5 (glm4_moe): Llama's layer with q/k/v biases and rope on the first half of each head (halves, not
pairs), and DeepSeek-V3's mixture of experts (sigmoid router, shared experts, dense first layers)."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.deepseek import SHARED_EXPERT_NAMES
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention, RMSNorm
from crane_mp.worker.models.llama import LlamaForCausalLM
from crane_mp.worker.platforms import Platform


class Glm4ForCausalLM(CausalLM):
    attention_class = PagedSelfAttention
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4MoeAttention(PagedSelfAttention):
    """Llama's attention, with Qwen3's per-head query and key norms before rope where the checkpoint
    has them (use_qk_norm)."""

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        self.qk_norm_position = "before_rope" if config.layout.qk_norm else None
        super().__init__(config, platform, layer)
        if config.layout.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm.weight, self.k_norm.weight


class Glm4MoeForCausalLM(LlamaForCausalLM):
    attention_class = Glm4MoeAttention
    renamed_weights = SHARED_EXPERT_NAMES
    skips_extra_layers = True  # the released checkpoints' next-token-prediction layer: its own model
    prediction_layer = "nextn"
