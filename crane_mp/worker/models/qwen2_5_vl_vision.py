"""Qwen2.5-VL's vision tower: patch embedding, 2-D rope, blocks that attend within windows of merged
patches (full attention over each image frame in `fullatt_block_indexes`), and the patch merger
that turns each 2x2 group of patches into one language-model embedding.

Float32 output equals transformers' Qwen2_5_VisionTransformerPretrainedModel (sdpa) bit for bit:
the same ops in the same order, one attention call per window or frame.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.models.checkpoint import copy_named
from crane_mp.worker.models.rope import apply_rope

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The fields of Qwen2_5_VLVisionConfig the tower reads; defaults are transformers' own."""

    depth: int = 32
    hidden_size: int = 3584
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def of(cls, config: Any) -> VisionConfig:
        """From config.json's vision_config dict or transformers' Qwen2_5_VLVisionConfig."""
        raw = config if isinstance(config, dict) else config.to_dict()
        default = cls()
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        values["fullatt_block_indexes"] = tuple(values.get("fullatt_block_indexes", default.fullatt_block_indexes))
        values["rope_theta"] = (raw.get("rope_parameters") or {}).get("rope_theta", default.rope_theta)
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class VisionRMSNorm(nn.Module):
    """transformers' formula (float32 variance, weight applied in the input dtype), for equal bits."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        self.patch_shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # A convolution whose stride is its kernel: one output per patch, as the checkpoint stores it.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, self.patch_shape[1:], self.patch_shape[1:], bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, *self.patch_shape).to(self.proj.weight.dtype)  # [N, C, T, P, P]
        return self.proj(x).view(x.shape[0], -1)  # [N, hidden]


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """x: [N, hidden]; attention within consecutive runs of `lengths` rows (windows or frames)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)  # [N, H, D]
        q = apply_rope(q.float(), cos, signed_sin).to(x.dtype)  # rope in float32, as transformers does
        k = apply_rope(k.float(), cos, signed_sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5).transpose(1, 2).contiguous()
                for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        return self.proj(torch.cat(outs, dim=1).reshape(n, -1))  # [N, hidden]


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, signed_sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))  # [N / merge**2, out_hidden]


class Qwen25VisionTower(nn.Module):
    """Checkpoint names, relative to the tower (Hub and transformers 5 save_pretrained files say
    `visual.` before them; transformers' in-memory state_dict says `model.visual.`):
    patch_embed.proj.weight, blocks.{i}.norm1.weight, blocks.{i}.attn.qkv.{weight,bias},
    blocks.{i}.attn.proj.{weight,bias}, blocks.{i}.norm2.weight,
    blocks.{i}.mlp.{gate_proj,up_proj,down_proj}.{weight,bias}, merger.ln_q.weight,
    merger.mlp.0.{weight,bias}, merger.mlp.2.{weight,bias}."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        cfg = self.cfg = VisionConfig.of(config)
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [sum(t * h * w), C * T * P * P], the images' patches in processor order;
        returns [sum(t * h * w) / merge**2, out_hidden_size], each image's merged patches in order."""
        cfg = self.cfg
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grid_thw):
            raise ValueError(f"{pixel_values.shape[0]} patches for image grids {grid_thw}")
        unit = cfg.spatial_merge_size**2
        units, window_lengths = window_order(grid_thw, cfg.spatial_merge_size,
                                             cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)
        units = units.to(pixel_values.device)
        patches = (units[:, None] * unit + torch.arange(unit, device=units.device)).flatten()  # window order
        frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        x = self.patch_embed(pixel_values)[patches]  # [N, hidden]
        cos, signed_sin = vision_rope(grid_thw, cfg.spatial_merge_size, cfg.head_dim, cfg.rope_theta, patches)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, signed_sin, frame_lengths if i in cfg.fullatt_block_indexes else window_lengths)
        return self.merger(x)[torch.argsort(units)]  # back to raster order of merged patches

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors named relative to the tower (see the class docstring); returns the
        parameter names filled."""
        return copy_named(dict(self.named_parameters()), weights)


def vision_rope(grid_thw: list[tuple[int, int, int]], merge: int, head_dim: int, theta: float,
                order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [N, 1, head_dim] of each patch's (row, column), in `order`: the first quarter
    of each head's frequencies turn with the row, the second with the column, the second half repeats.
    Computed per call in float32 (no buffer: the loaders build the model on the meta device)."""
    rows, columns = [], []
    for t, h, w in grid_thw:
        # Patches come merge block by merge block: [h / m, w / m, m, m], row-major within each.
        row = torch.arange(h).view(h // merge, 1, merge, 1).expand(h // merge, w // merge, merge, merge).flatten()
        column = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, w // merge, merge, merge).flatten()
        rows.append(row.repeat(t))
        columns.append(column.repeat(t))
    positions = torch.stack([torch.cat(rows), torch.cat(columns)], dim=1).to(order.device)  # [N, 2]
    spatial_dim = head_dim // 2  # each axis's frequencies: every other one of half a head
    exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float32, device=order.device) / spatial_dim
    freqs = positions[..., None].float() * (1.0 / theta**exponents)  # [N, 2, head_dim / 4]
    half = freqs.shape[-1] * 2
    cos, sin = (f.flatten(1).repeat(1, 2)[order] for f in (freqs.cos(), freqs.sin()))  # [N, head_dim]
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.unsqueeze(1), signed_sin.unsqueeze(1)


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged-patch indices in window order, and each window's length in patches.

    Each frame's (h / m) x (w / m) grid of merged patches is cut into window x window tiles (smaller at
    the right and bottom edges), taken tile row by tile row; within a tile, raster order:

        0  1 | 2        tiles of 2, a 3 x 3 grid:  [0 1 3 4] [2 5] [6 7] [8]
        3  4 | 5
        ---------
        6  7 | 8
    """
    units: list[torch.Tensor] = []
    lengths: list[int] = []
    first = 0
    for t, h, w in grid_thw:
        rows, columns = h // merge, w // merge
        grid = torch.arange(first, first + t * rows * columns).view(t, rows, columns)
        for frame in grid:
            for top in range(0, rows, window):
                for left in range(0, columns, window):
                    tile = frame[top : top + window, left : left + window].flatten()
                    units.append(tile)
                    lengths.append(tile.numel() * merge * merge)
        first += t * rows * columns
    return torch.cat(units), lengths
