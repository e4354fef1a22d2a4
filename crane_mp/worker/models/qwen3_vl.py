"""Qwen3-VL and Qwen3.5 with images: Qwen3's (or Qwen3.5's hybrid) language model with interleaved
multimodal rope, and Qwen3-VL's vision tower, whose deepstack features Qwen3-VL adds to the outputs
of its first language-model layers at the image's rows (Qwen3.5's tower has none)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

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
    """Also Qwen3-VL-MoE (qwen3_vl_moe: its layout has experts), whose checkpoints hold each layer's
    experts fused (fused_experts)."""

    renamed_weights = {"model.language_model.": "model."}

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        _add_tower(self, config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = self.config.layout.experts
        if experts is None:
            return super().load_weights(weights)
        return super().load_weights(fused_experts(weights, self.config.hidden_size, experts.intermediate_size))


def fused_experts(weights: Iterable[tuple[str, torch.Tensor]], hidden: int,
                  intermediate: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-VL-MoE's fused expert tensors as every expert's stacked projections (`experts.gate_proj.weight`
    [experts, intermediate, hidden], up's, down's [experts, hidden, intermediate]). The released files
    hold gate_up_proj [experts, hidden, 2 x intermediate] and down_proj [experts, intermediate, hidden];
    transformers 5 saves them transposed ([experts, 2 x intermediate, hidden], [experts, hidden,
    intermediate]): told apart by their shapes (where the sizes make them equal, transformers 5's)."""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj"):
            if tensor.shape[1:] != (2 * intermediate, hidden):
                tensor = tensor.transpose(1, 2)
            yield name.removesuffix("gate_up_proj") + "gate_proj.weight", tensor[:, :intermediate]
            yield name.removesuffix("gate_up_proj") + "up_proj.weight", tensor[:, intermediate:]
        elif name.endswith(".experts.down_proj"):
            yield name + ".weight", tensor if tensor.shape[1:] == (hidden, intermediate) else tensor.transpose(1, 2)
        else:
            yield name, tensor


class Qwen35VLForConditionalGeneration(ImageLanguageModel, Qwen35ForCausalLM):
    ignored_weights = ()

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        _add_tower(self, config)
