"""Helpers for tests that run a loaded model directly, without an engine."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

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


ZOO_PROMPT_LENGTHS = [23, 9, 40, 17, 31, 5]


def zoo_references(root: Path, num_tokens: int) -> Callable[[str], tuple[Path, list[list[int]], list[list[int]]]]:
    """family -> (its tiny zoo checkpoint under `root`, seeded prompts, transformers' float32 greedy tokens
    on CPU), each family built once."""
    from transformers import AutoModelForCausalLM

    from crane_mp.testing.make_zoo import make_zoo_model

    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            path = make_zoo_model(family, root / family)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            gen = torch.Generator().manual_seed(len(family))
            prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in ZOO_PROMPT_LENGTHS]
            with torch.inference_mode():
                expected = [hf.generate(torch.tensor([p]), max_new_tokens=num_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
            made[family] = path, prompts, expected
        return made[family]

    return get
