"""The per-step forward context: attention metadata and rope rows, set by the runner around one forward pass.

Model code keeps `forward(input_ids, positions)`; attention layers read the context instead of threading
metadata through every call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from crane_mp.worker.attention import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor  # [num_tokens, 1, head_dim]


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _current
    _current = ctx
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("model forward called outside forward_context()")
    return _current
