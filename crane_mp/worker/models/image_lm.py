"""Vision-language models whose image encoders' outputs take the places of each image's placeholder
tokens in the prompt (ImageLanguageModel, a mixin before the language model's class): Qwen2.5-VL,
Qwen3-VL and Qwen3.5 (placed by multimodal rope), Gemma 3 (plain positions, bidirectional attention
within each image).

Each image is encoded once per request, alone (the memory plan holds the largest one), the first step
that computes any of its placeholders (a chunked prompt may split them over steps, but for Gemma 3), and
its features are kept with the request through preemptions while its pixels are dropped. Text-only
requests of a multimodal-rope model run as on its text model: their three rope positions are equal, and
the sections then compose the one-position tables exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import msgspec
import numpy as np
import torch
from torch import nn

from crane_mp.mrope import mrope_positions
from crane_mp.protocol import MediaInput
from crane_mp.worker.step.forward_context import MediaSpan, MediaStep


@dataclass(slots=True)
class VisionFeatures:
    """The tower's output: [merged patches, out_hidden] for the placeholders, and per deepstack layer the
    same shape, added to the language model's hidden states after its first layers."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    def rows(self, first: int, last: int) -> VisionFeatures:
        return VisionFeatures(self.embeds[first:last], [layer[first:last] for layer in self.deepstack])


@dataclass(slots=True)
class PromptImages:
    """A request's images, its prompt's rope positions [3, prompt] and the offset of later positions
    (None, 0 for a model with plain positions)."""

    images: list[MediaInput]
    positions: torch.Tensor | None
    delta: int
    encoded: dict[int, VisionFeatures] = field(default_factory=dict)  # image index -> its placeholders' features


class ImageLanguageModel:
    """A causal LM whose images' tower embeddings take their placeholders' places (a mixin before the
    language model's class): its `visual` tower turns images into VisionFeatures (or a tensor of the
    placeholders' embeddings), placed by multimodal rope positions (mrope.py) where `mrope`."""

    media_kind = "image"
    visual: nn.Module
    image_token_id: int
    video_token_id: int | None = None  # a video's frame pairs come as images under this placeholder (Qwen3-VL)
    merge_size: int
    mrope = True
    # An image's placeholders attend to each other both ways (Gemma 3): never split over steps.
    bidirectional_images = False
    # Checkpoint-name prefixes of the vision side, and what they become under `visual`.
    visual_prefixes: dict[str, str] = {"model.visual.": "", "visual.": ""}

    def media_state(self, prompt_ids: list[int], media: list[MediaInput]) -> PromptImages | None:
        if not media:
            return None
        for item in media:
            self._check_image(prompt_ids, item)
        if not self.mrope:
            return PromptImages(list(media), None, 0)
        spans = [(item.offset, *item.grid) for item in media]
        positions, delta = mrope_positions(prompt_ids, spans, self.merge_size)
        return PromptImages(list(media), torch.from_numpy(np.ascontiguousarray(positions)), int(delta))

    def _check_image(self, prompt_ids: list[int], item: MediaInput) -> None:
        if item.kind != "image":
            raise ValueError(f"{self.config.arch} takes images, not {item.kind}")
        t, h, w = item.grid
        if item.num_tokens * self.merge_size**2 != t * h * w or item.shape != [t * h * w, item.shape[-1]]:
            raise ValueError(f"image grid {item.grid} does not match its {item.num_tokens} placeholders")
        placeholders = prompt_ids[item.offset : item.offset + item.num_tokens]
        if len(placeholders) != item.num_tokens or set(placeholders) not in ({self.image_token_id},
                                                                             {self.video_token_id}):
            raise ValueError("an image's placeholder tokens are not where its offset says")

    def prepare_media(self, spans: list[MediaSpan], positions: torch.Tensor) -> MediaStep:
        """Rope positions of every row (plain ones for text-only requests; none without mrope), the image
        rows' embeddings and deepstack additions, and the images whose placeholders attend both ways
        (bidirectional_images: (row of the request's first, first position, end)), encoding each image
        this step reaches first."""
        self._encode([(span.state, i) for span in spans for i, item in enumerate(span.state.images)
                      if i not in span.state.encoded and _overlaps(item, span.start, span.end)])
        rope = positions.expand(3, -1).clone() if self.mrope else None
        rows, values, both_ways = [], [], []
        for span in spans:
            state = span.state
            if rope is not None:
                rope[:, span.row : span.row + span.end - span.start] = self._rope_rows(state, span.start, span.end)
            for index, item in enumerate(state.images):
                first, last = max(span.start, item.offset), min(span.end, item.offset + item.num_tokens)
                if first < last:
                    rows.append(torch.arange(first, last) - span.start + span.row)
                    values.append(state.encoded[index].rows(first - item.offset, last - item.offset))
                    if self.bidirectional_images:
                        both_ways.append((span.row, item.offset, item.offset + item.num_tokens))
        if not rows:
            return MediaStep(None, rope)
        embeds = (torch.cat(rows).to(positions.device), torch.cat([part.embeds for part in values]))
        deepstack = [torch.cat(layer) for layer in zip(*(part.deepstack for part in values))]
        return MediaStep(embeds, rope, deepstack or None, both_ways or None)

    def _rope_rows(self, state: PromptImages, start: int, end: int) -> torch.Tensor:
        prompt = state.positions.shape[1]
        known = state.positions[:, start:min(end, prompt)]
        later = torch.arange(max(start, prompt), max(end, prompt), dtype=known.dtype) + state.delta
        return torch.cat([known, later.expand(3, -1)], dim=1)

    def _encode(self, wanted: list[tuple[PromptImages, int]]) -> None:
        """Each image through the tower alone: a step's peak is one image's, the largest the plan holds."""
        weight = next(self.visual.parameters())
        for state, i in wanted:
            item = state.images[i]
            # torch.tensor copies: the message's bytes are read-only.
            pixels = torch.tensor(np.frombuffer(item.values, dtype=np.float32).reshape(item.shape))
            features = self.visual(pixels.to(device=weight.device, dtype=weight.dtype), [tuple(item.grid)])
            state.encoded[i] = features if isinstance(features, VisionFeatures) else VisionFeatures(features, [])
            # Encoded once per request: the pixels are not read again.
            state.images[i] = msgspec.structs.replace(item, values=b"")

    def largest_image(self, model_dir: Path, overrides: dict[str, int]) -> tuple[int, int, int] | None:
        """The patch grid of the largest image the frontend's processor makes: max_pixels (the
        checkpoint's preprocessor_config.json, or --mm-processor-kwargs') as a square; None where the
        checkpoint has no processor settings (it serves text only)."""
        path = model_dir / "preprocessor_config.json"
        if not path.is_file():
            return None
        settings = json.loads(path.read_text())
        max_pixels = (overrides.get("max_pixels") or settings.get("max_pixels")
                      or (settings.get("size") or {}).get("longest_edge"))
        if not max_pixels:
            return None
        cfg = self.visual.cfg
        side = max(cfg.spatial_merge_size, math.isqrt(max_pixels // cfg.patch_size**2)
                   // cfg.spatial_merge_size * cfg.spatial_merge_size)
        return 1, side, side

    def vision_activation_bytes(self, grid: tuple[int, int, int]) -> int:
        """The tower's live activations on `grid` (the CPU memory plan's estimate, as
        _activation_estimate_per_token's for the language model): a block's widest point per patch,
        q/k/v and the MLP's, then the merged embeddings the request keeps."""
        cfg = self.visual.cfg
        patches = math.prod(grid)
        widths = 6 * cfg.hidden_size + 3 * cfg.intermediate_size
        kept = patches // cfg.spatial_merge_size**2 * cfg.out_hidden_size * (1 + len(getattr(
            cfg, "deepstack_visual_indexes", ())))
        return (patches * widths + kept) * 4

    def profile_image(self, grid: tuple[int, int, int]) -> None:
        """One pass of the tower over an image of `grid` (the measured memory plan's peak)."""
        cfg = self.visual.cfg
        weight = next(self.visual.parameters())
        values = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.visual(torch.zeros(math.prod(grid), values, dtype=weight.dtype, device=weight.device), [grid])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        visual: list[tuple[str, torch.Tensor]] = []

        def language(pairs):
            for name, tensor in pairs:
                prefix = next((p for p in self.visual_prefixes if name.startswith(p)), None)
                if prefix is None:
                    yield name, tensor
                else:
                    visual.append((self.visual_prefixes[prefix] + name.removeprefix(prefix), tensor))

        loaded = super().load_weights(language(weights))
        return loaded | {"visual." + name for name in self.visual.load_weights(visual)}


def _overlaps(item: MediaInput, start: int, end: int) -> bool:
    return item.offset < end and start < item.offset + item.num_tokens
