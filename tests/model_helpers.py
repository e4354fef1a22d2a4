"""Helpers for tests that run a loaded model directly, without an engine."""

from __future__ import annotations

from pathlib import Path

import torch

from crane_mp.models.config import ModelConfig
from crane_mp.models.gguf_file import ModelSource
from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.step.runner import ModelRunner
from crane_mp.worker.weights.loader import load_model

CPU = platform_for("cpu")  # what the worker is handed on a CPU host


def prefill_logits(model: CausalLM, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Float32 logits [len(prompt), vocab] of one fresh prefill of `prompt` on CPU."""
    runner = ModelRunner(model, block_size, len(prompt) + block_size, CPU)
    num_blocks = -(-len(prompt) // block_size)
    runner.allocate_kv_cache(num_blocks)
    span = SeqSpan(0, len(prompt), list(range(num_blocks)))
    with torch.inference_mode():
        return model.compute_logits(runner.forward([], [span], prompt, list(range(len(prompt))))).float()


def load_checkpoint(config: ModelConfig, model_dir: Path, dtype: torch.dtype) -> CausalLM:
    """A safetensors checkpoint loaded on CPU as the worker loads it (packing included)."""
    return load_model(config, ModelSource("safetensors", Path(model_dir)), dtype, CPU, progress=False)[0]
