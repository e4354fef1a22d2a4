"""Gemma 3's vision side: the SigLIP tower (patch convolution plus learned positions, LayerNorm
encoder layers with full attention over the image, a final LayerNorm) and the projector that average-
pools its patch grid to mm_tokens_per_image tokens, normalises them ((1 + w) RMSNorm) and projects them
into the language model's width.

Float32 output equals transformers' SiglipVisionModel + Gemma3MultiModalProjector (sdpa) bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.models.checkpoint import copy_named
from crane_mp.worker.models.layers import ACTIVATIONS


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    """The fields of SiglipVisionConfig the tower reads (Gemma 3's defaults)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @classmethod
    def of(cls, config: Any) -> SiglipConfig:
        raw = config if isinstance(config, dict) else config.to_dict()
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [images, patches, hidden]; every patch attends to its whole image."""
        shape = (*x.shape[:2], self.num_heads, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1).contiguous())


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[None]


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: SiglipConfig, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(cfg.hidden_size, text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(cfg.hidden_size))
        self.eps = cfg.layer_norm_eps
        self.side = cfg.patches_per_side
        self.kernel = self.side // int(tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [images, side * side, hidden] -> [images, tokens_per_image, text hidden]."""
        images, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(images, hidden, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = normed * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(normed.type_as(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3Vision(nn.Module):
    """The tower and projector under their checkpoint names: vision_tower.* (the released files say
    vision_tower.vision_model.*; load_weights takes both) and multi_modal_projector.*. Takes pixel values
    [images, C, H, W] (each a whole image or a pan-and-scan crop), returns [images * tokens_per_image,
    text hidden]."""

    def __init__(self, vision_config: Any, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.cfg = SiglipConfig.of(vision_config)
        self.tokens_per_image = tokens_per_image
        self.vision_tower = SiglipVisionTransformer(self.cfg)
        self.multi_modal_projector = MultiModalProjector(self.cfg, text_hidden, tokens_per_image)

    def forward(self, pixel_values: torch.Tensor, grids: Any = None) -> torch.Tensor:
        """`grids`: unused (every image is image_size square), as the Qwen towers' call passes them."""
        features = self.multi_modal_projector(self.vision_tower(pixel_values))
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A pooling head (vision_use_head) is not read: Gemma 3 takes the tower's last hidden state.
        return copy_named(dict(self.named_parameters()),
                          ((name.replace("vision_tower.vision_model.", "vision_tower."), tensor)
                           for name, tensor in weights if ".head." not in name))
