"""Qwen2 / Qwen2.5: Llama layout with biases on the Q, K and V projections (none on the output projection)."""

from __future__ import annotations

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention
from crane_mp.worker.platforms import Platform


class Qwen2Attention(PagedSelfAttention):
    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(CausalLM):
    attention_class = Qwen2Attention
