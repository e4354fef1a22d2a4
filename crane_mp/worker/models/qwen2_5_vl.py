"""Qwen2.5-VL: the Qwen2 language model with multimodal rope, and a vision tower whose embeddings
take the places of each image's placeholder tokens (image_lm.py)."""

from __future__ import annotations

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.image_lm import ImageLanguageModel
from crane_mp.worker.models.qwen2 import Qwen2ForCausalLM
from crane_mp.worker.models.qwen2_5_vl_vision import Qwen25VisionTower
from crane_mp.worker.platforms import Platform


class Qwen25VLForConditionalGeneration(ImageLanguageModel, Qwen2ForCausalLM):
    renamed_weights = {"model.language_model.": "model."}

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        hf = config.hf_config
        self.visual = Qwen25VisionTower(hf.vision_config)
        self.image_token_id = hf.image_token_id
        self.merge_size = hf.vision_config.spatial_merge_size
