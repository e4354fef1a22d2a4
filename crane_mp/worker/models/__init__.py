"""Model implementations, one architecture per file, and the registry that maps a checkpoint to one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from crane_mp.worker.model_config import ModelConfig


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
