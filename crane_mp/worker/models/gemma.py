"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP (tanh GELU) between four (1 + w) RMSNorms,
sliding and global layers, a scaled embedding and query scale, soft-capping (Gemma 2), per-head q/k norms
and the sliding layers' own rope base (Gemma 3). The DecoderLayout carries all but the q/k norms."""

from __future__ import annotations

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.layers import CausalLM, GemmaRMSNorm, PagedSelfAttention
from crane_mp.worker.platforms import Platform


class Gemma2ForCausalLM(CausalLM):
    attention_class = PagedSelfAttention


class Gemma3Attention(PagedSelfAttention):
    qk_norm_position = "before_rope"

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__(config, platform, layer)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return 1.0 + self.q_norm.weight, 1.0 + self.k_norm.weight  # the shared q/k norm multiplies by w


class Gemma3ForCausalLM(CausalLM):
    """Also the language model of a Gemma 3 vision-language checkpoint (gemma3_vl.py)."""

    attention_class = Gemma3Attention
    # The released checkpoints' names (language_model.model.*), then transformers 5's in memory.
    renamed_weights = {"language_model.lm_head.": "lm_head.", "language_model.model.": "model.",
                       "model.language_model.": "model."}
    # A vision-language checkpoint served for text alone (--model-type gemma3): its vision side unread.
    ignored_weights = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
