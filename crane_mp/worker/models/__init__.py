"""Model implementations, one architecture per file, and the registry that maps a checkpoint to one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from crane_mp.worker.model_config import ModelConfig


def build_meta_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device (no memory, no initialisation), its parameters typed `dtype`;
    loaders then allocate what they fill."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return build_model(config)
    finally:
        torch.set_default_dtype(previous)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta tensor uninitialised memory on `device`. torch.empty, not Module.to_empty: its
    empty_like on meta tensors costs ~0.8 s of one-time imports at start-up."""
    import torch

    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t)


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate the (uninitialised) model for `config.arch` on the current default device and dtype."""
    from crane_mp.worker.models import hunyuan, llama, qwen2, qwen3

    classes = {
        "llama": llama.LlamaForCausalLM,
        "mistral": llama.LlamaForCausalLM,
        "qwen2": qwen2.Qwen2ForCausalLM,
        "qwen3": qwen3.Qwen3ForCausalLM,
        "hunyuan": hunyuan.HunYuanDenseForCausalLM,
    }
    return classes[config.arch](config)
