"""Build the model a ModelConfig names: its class from the registry's row, on the meta device for the loaders."""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.models.registry import ARCHITECTURES
from crane_mp.worker.platforms import Platform


def model_class(arch: str) -> type[nn.Module]:
    """The class serving architecture `arch` (crane_mp/models/registry.py's `model_class`, imported on
    first use)."""
    module, _, name = ARCHITECTURES[arch].model_class.rpartition(".")
    return getattr(importlib.import_module(module if "." in module else f"crane_mp.worker.models.{module}"), name)


def build_model(config: ModelConfig, platform: Platform) -> nn.Module:
    """Instantiate the (uninitialised) model for `config.arch` on the current default device and dtype,
    its layers calling `platform`'s kernels."""
    return model_class(config.arch)(config, platform)


def build_meta_model(config: ModelConfig, dtype: torch.dtype, platform: Platform) -> nn.Module:
    """The model on the meta device (no memory, no initialisation), its parameters typed `dtype`;
    loaders then allocate what they fill."""
    return on_meta(lambda: build_model(config, platform), dtype)


def on_meta(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """What `make` builds, its new parameters on the meta device and typed `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return make()
    finally:
        torch.set_default_dtype(previous)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta tensor uninitialised memory on `device`. torch.empty, not Module.to_empty: its
    empty_like on meta tensors costs ~0.8 s of one-time imports at start-up."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t)
