"""Qwen3-VL and Qwen3.5 with images: Qwen3's (or Qwen3.5's hybrid) language model with interleaved
multimodal rope, and Qwen3-VL's vision tower, whose deepstack features Qwen3-VL adds to the outputs
of its first language-model layers at the image's rows (Qwen3.5's tower has none)."""

from __future__ import annotations

from crane_mp.models.config import ModelConfig
from crane_mp.worker.models.image_lm import ImageLanguageModel
from crane_mp.worker.models.qwen3 import Qwen3ForCausalLM
from crane_mp.worker.models.qwen3_5 import Qwen35ForCausalLM
from crane_mp.worker.models.qwen3_vl_vision import Qwen3VisionTower
from crane_mp.worker.platforms import Platform


def _add_tower(model: ImageLanguageModel, config: ModelConfig) -> None:
    hf = config.hf_config
    model.visual = Qwen3VisionTower(hf.vision_config)
    model.image_token_id = hf.image_token_id
    model.video_token_id = hf.video_token_id
    model.merge_size = model.visual.cfg.spatial_merge_size


class Qwen3VLForConditionalGeneration(ImageLanguageModel, Qwen3ForCausalLM):
    renamed_weights = {"model.language_model.": "model."}

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        _add_tower(self, config)


class Qwen35VLForConditionalGeneration(ImageLanguageModel, Qwen35ForCausalLM):
    ignored_weights = ()

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        _add_tower(self, config)
