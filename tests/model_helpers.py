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
    runner.allocate_kv_cache(-(-len(prompt) // block_size) * len(runner.kv_groups.windows))
    span = prefill_span(runner, len(prompt))
    with torch.inference_mode():
        return model.compute_logits(runner.forward([], [span], prompt, list(range(len(prompt))))).float()


def prefill_span(runner: ModelRunner, num_tokens: int) -> SeqSpan:
    """A fresh prefill of `num_tokens` over the first blocks of `runner`'s cache, each KV group its own
    (as ids into its cache views, kv_groups.py): groups share cache tensors."""
    num_blocks = -(-num_tokens // runner.block_size)
    tables = [[(group * num_blocks + block) * scale for block in range(num_blocks)]
              for group, scale in enumerate(runner.kv_groups.scales)]
    return SeqSpan(0, num_tokens, tables[0], tables[1:])


def load_checkpoint(config: ModelConfig, model_dir: Path, dtype: torch.dtype) -> CausalLM:
    """A safetensors checkpoint loaded on CPU as the worker loads it (packing included)."""
    return load_model(config, ModelSource("safetensors", Path(model_dir)), dtype, CPU, progress=False)[0]


ZOO_PROMPT_LENGTHS = [23, 9, 40, 17, 31, 5]


def zoo_references(root: Path, num_tokens: int) -> Callable[[str], tuple[Path, list[list[int]], list[list[int]]]]:
    """family -> (its tiny zoo checkpoint under `root`, seeded prompts, transformers' float32 greedy tokens
    on CPU), each family built once."""
    from crane_mp.testing.make_zoo import make_zoo_model

    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            path = make_zoo_model(family, root / family)
            gen = torch.Generator().manual_seed(len(family))
            prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in ZOO_PROMPT_LENGTHS]
            made[family] = path, prompts, transformers_greedy(path, prompts, num_tokens)
        return made[family]

    return get


def transformers_greedy(path: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy tokens on CPU for each prompt (no end of sequence)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
