"""Gemma 3 with images: Gemma 3's language model, and the SigLIP tower whose pooled, projected output
(mm_tokens_per_image tokens per image or pan-and-scan crop) takes the places of the image's soft tokens
after the token embeddings are scaled. An image's soft tokens attend to each other both ways, in sliding
and global layers alike, so the scheduler never splits them over steps nor a prefix-cache hit."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.protocol import MediaInput
from crane_mp.worker.models.gemma import Gemma3ForCausalLM
from crane_mp.worker.models.gemma3_vision import Gemma3Vision
from crane_mp.worker.models.image_lm import ImageLanguageModel
from crane_mp.worker.platforms import Platform


class Gemma3VLForConditionalGeneration(ImageLanguageModel, Gemma3ForCausalLM):
    mrope = False
    bidirectional_images = True
    ignored_weights = ()
    # transformers 5 writes vision_tower.* and multi_modal_projector.*; the released files put
    # vision_model under the tower; transformers' state_dict says model.* before both.
    visual_prefixes = {prefix + part: part for prefix in ("model.", "") for part in
                       ("vision_tower.", "multi_modal_projector.")}

    def __init__(self, config: ModelConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        hf = config.hf_config
        self.visual = Gemma3Vision(hf.vision_config, config.hidden_size, hf.mm_tokens_per_image)
        self.image_token_id = hf.image_token_id

    def _check_image(self, prompt_ids: list[int], item: MediaInput) -> None:
        if item.kind != "image":
            raise ValueError(f"{self.config.arch} takes images, not {item.kind}")
        cfg = self.visual.cfg
        if item.num_tokens != self.visual.tokens_per_image or item.shape != [1, cfg.num_channels, cfg.image_size,
                                                                           cfg.image_size]:
            raise ValueError(f"an image of shape {item.shape} and {item.num_tokens} placeholders: this model takes "
                             f"{cfg.image_size} x {cfg.image_size} images of {self.visual.tokens_per_image}")
        placeholders = prompt_ids[item.offset : item.offset + item.num_tokens]
        if len(placeholders) != item.num_tokens or set(placeholders) != {self.image_token_id}:
            raise ValueError("an image's placeholder tokens are not where its offset says")

    def largest_image(self, model_dir: Path, overrides: dict[str, int]) -> tuple[int, int, int] | None:
        """Every image (and crop) is resized to the tower's square."""
        side = self.visual.cfg.patches_per_side
        return 1, side, side

    def vision_activation_bytes(self, grid: tuple[int, int, int]) -> int:
        cfg = self.visual.cfg
        patches = math.prod(grid)
        # A layer's widest point per patch, and each head's attention weights (SigLIP's sequence is short).
        widths = 6 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.num_attention_heads * patches
        return (patches * widths + self.visual.tokens_per_image * self.config.hidden_size) * 4

    def profile_image(self, grid: tuple[int, int, int]) -> None:
        cfg = self.visual.cfg
        weight = next(self.visual.parameters())
        self.visual(torch.zeros(1, cfg.num_channels, cfg.image_size, cfg.image_size, dtype=weight.dtype,
                                device=weight.device))
