"""Multimodal rope (Qwen2.5-VL, Qwen3-VL): each token's cos/sin rows composed from the one-position tables of
rope.py, section by section, for its temporal, height and width positions."""

from __future__ import annotations

import torch


def mrope_columns(mrope_section: list[int] | tuple[int, ...], interleaved: bool = False,
                  rotary_dim: int | None = None) -> torch.Tensor:
    """Which position (0 temporal, 1 height, 2 width) each of the `rotary_dim` rope columns follows.

    The sections split the first half, frequency by frequency, and the second half repeats them
    (rotate-half layout), as transformers' recomposition_frequencies does. In three runs (Qwen2.5-VL,
    which cycles m[i % 3]; they fill the half), or interleaved (Qwen3-VL: frequency 3j + 1 follows
    the height for j < s1, 3j + 2 the width for j < s2, every other frequency the time, whatever the
    sections sum to):

        runs          [ t t t | h h h | w w ][ same ]
        interleaved   [ t h w t h w t h w t t ][ same ]
    """
    if not interleaved:
        half = torch.cat([torch.full((size,), i % 3, dtype=torch.int64) for i, size in enumerate(mrope_section)])
        return torch.cat([half, half])
    half = torch.zeros((rotary_dim or 2 * sum(mrope_section)) // 2, dtype=torch.int64)
    for axis in (1, 2):
        half[axis : mrope_section[axis] * 3 : 3] = axis
    return torch.cat([half, half])


def mrope_cos_sin(cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor,
                  columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/signed_sin: rope_tables' [max_positions, head_dim]; positions: [3, T]; columns: mrope_columns'.

    Returns (cos, signed_sin), each [T, 1, head_dim], for apply_rope. Each entry is copied from the
    table row of its column's position, so it equals transformers' composed cos/sin bit for bit: the
    table and the reference compute the same cos(position * inv_freq) per frequency.
    """
    head_dim = cos.shape[-1]
    rows = positions.to(cos.device)[columns.to(cos.device)].T  # [T, head_dim]: the table row per entry
    index = torch.arange(head_dim, device=cos.device)
    # contiguous: indexing by the transposed rows keeps their strides, and the fused rope kernel reads rows.
    return cos[rows, index].contiguous().unsqueeze(1), signed_sin[rows, index].contiguous().unsqueeze(1)
