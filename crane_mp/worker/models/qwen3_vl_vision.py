"""Qwen3-VL's vision tower (also Qwen3.5's, which has no deepstack): patch embedding plus a learned
position grid resampled to each image, 2-D rope, LayerNorm blocks with full attention over each frame,
the patch merger, and the deepstack mergers whose outputs are added to the first language-model layers.

Float32 output equals transformers' Qwen3VLVisionModel / Qwen3_5VisionModel (sdpa) bit for bit: the
same ops in the same order, one attention call per frame.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.models.checkpoint import copy_named
from crane_mp.worker.models.image_lm import VisionFeatures
from crane_mp.worker.models.layers import ACTIVATIONS
from crane_mp.worker.models.qwen2_5_vl_vision import PatchEmbed, VisionAttention, vision_rope


@dataclass(frozen=True, slots=True)
class Qwen3VisionConfig:
    """The fields of Qwen3VLVisionConfig / Qwen3_5VisionConfig the tower reads; defaults are transformers'."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    @classmethod
    def of(cls, config: Any) -> Qwen3VisionConfig:
        """From config.json's vision_config dict or transformers' config object. Qwen3.5's has no
        deepstack_visual_indexes (none: no deepstack)."""
        raw = config if isinstance(config, dict) else config.to_dict()
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        values["deepstack_visual_indexes"] = tuple(values.get("deepstack_visual_indexes") or ())
        values["rope_theta"] = float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, signed_sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's patches into one embedding. The final merger normalises each patch first; a
    deepstack merger (`after_merge`) normalises the merged block."""

    def __init__(self, cfg: Qwen3VisionConfig, after_merge: bool) -> None:
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.merged_size if after_merge else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_size)) if self.after_merge else self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Checkpoint names, relative to the tower (after `model.visual.` or `visual.`): patch_embed.proj.
    {weight,bias}, pos_embed.weight, blocks.{i}.norm{1,2}.{weight,bias}, blocks.{i}.attn.{qkv,proj}.
    {weight,bias}, blocks.{i}.mlp.linear_fc{1,2}.{weight,bias}, merger.{norm,linear_fc1,linear_fc2}.
    {weight,bias}, deepstack_merger_list.{j}.{norm,linear_fc1,linear_fc2}.{weight,bias}."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        cfg = self.cfg = Qwen3VisionConfig.of(config)
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, after_merge=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionFeatures:
        """pixel_values: [sum(t * h * w), C * T * P * P], the images' patches in processor order (merge
        block by merge block); returns each image's merged patches in order."""
        cfg = self.cfg
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grid_thw):
            raise ValueError(f"{pixel_values.shape[0]} patches for image grids {grid_thw}")
        x = self.patch_embed(pixel_values)
        taps, weights = position_taps(grid_thw, cfg.spatial_merge_size, self.grid_side, x.device)
        x = x + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(x.dtype)
        order = torch.arange(x.shape[0], device=x.device)
        cos, signed_sin = vision_rope(grid_thw, cfg.spatial_merge_size, cfg.head_dim, cfg.rope_theta, order)
        frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, signed_sin, frame_lengths)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return VisionFeatures(self.merger(x), deepstack)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_named(dict(self.named_parameters()), weights)


def position_taps(grid_thw: list[tuple[int, int, int]], merge: int, side: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's four rows of the side x side learned position grid and their bilinear weights
    (corners aligned), [N, 4] each, as the grid resampled to the image's h x w patches; patches in
    processor order (merge block by merge block), each frame of an image the same."""
    taps, weights = [], []
    for t, h, w in grid_thw:
        row = torch.arange(h).view(h // merge, 1, merge, 1).expand(h // merge, w // merge, merge, merge).flatten()
        column = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, w // merge, merge, merge).flatten()
        row_taps, row_weights = _axis_taps(row, h, side)
        column_taps, column_weights = _axis_taps(column, w, side)
        taps.append((row_taps[:, :, None] * side + column_taps[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((row_weights[:, :, None] * column_weights[:, None, :]).reshape(-1, 4).repeat(t, 1))
    return torch.cat(taps).to(device), torch.cat(weights).to(device)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two grid rows (clamped to the edge) either side of each index's source point, and their
    linear weights; the float32 ops in transformers' order, for equal weights."""
    source = index.float() * (side - 1) / torch.tensor(max(size - 1, 1))
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
