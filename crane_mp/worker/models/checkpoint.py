"""Copying checkpoint tensors into a model's parameters, refusing names and shapes that do not fit."""

from __future__ import annotations

from typing import Iterable

import torch


def fill(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """copy_ would broadcast a tensor of the wrong shape (an [N] row over an [M, N] matrix) in silence."""
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                         f"{list(target.shape)}: a checkpoint for another configuration?")
    target.copy_(tensor)


def copy_named(params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Each (name, tensor) into params[name]; returns the names filled. An unknown name is a KeyError."""
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
        fill(params[name].data, tensor, name)
        loaded.add(name)
    return loaded
