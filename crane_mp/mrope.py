"""Qwen2.5-VL's multimodal rope positions: (temporal, height, width) ids per prompt token, as
transformers' get_rope_index computes them for text and images. Torch-free (numpy), so any process
may compute them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def mrope_positions(input_ids: Sequence[int], images: Sequence[tuple[int, int, int, int]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, len(input_ids)] int64 and the delta of the tokens after the prompt.

    `images`: (start offset, grid_t, grid_h, grid_w) per image, its t * h * w / merge**2 placeholder
    tokens starting at the offset. Text advances all three ids by one per token. An image's tokens
    take (p + t, p + row, p + column) over its merged grid, p being the position after the text
    before it, and the text after it resumes at p + max(h, w) / merge:

        ids    ... text  | img: t*(h/m)*(w/m) tokens           | text ...
        t      ... p-1   | p+0 ... p+t-1                        | q q+1 ...   q = p + max(h, w) / m
        h      ... p-1   | p+0 ... p+h/m-1 (row)                | q q+1 ...
        w      ... p-1   | p+0 ... p+w/m-1 (column)             | q q+1 ...

    Generated token i (position len(input_ids) + i) has all three ids len(input_ids) + i + delta,
    delta = max(prompt ids) + 1 - len(input_ids), zero or negative.
    """
    num_tokens = len(input_ids)
    positions = np.empty((3, num_tokens), dtype=np.int64)
    position = cursor = 0
    for start, grid_t, grid_h, grid_w in sorted(images):
        rows, columns = grid_h // spatial_merge_size, grid_w // spatial_merge_size
        count = grid_t * rows * columns
        if start < cursor or start + count > num_tokens:
            raise ValueError(f"image tokens [{start}, {start + count}) overlap another image or leave the prompt")
        positions[:, cursor:start] = np.arange(position, position + start - cursor)
        position += start - cursor
        t, h, w = np.meshgrid(np.arange(grid_t), np.arange(rows), np.arange(columns), indexing="ij")
        positions[:, start : start + count] = np.stack([t, h, w]).reshape(3, count) + position
        position += max(grid_h, grid_w) // spatial_merge_size
        cursor = start + count
    positions[:, cursor:] = np.arange(position, position + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
