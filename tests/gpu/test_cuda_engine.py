"""CUDA paths: same greedy tokens as the CPU engine, and the memory limit honoured. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from crane_mp.config import EngineConfig, parse_memory_limit
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.worker.memory import MemoryBudgetError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3"))


def test_cuda_greedy_matches_cpu_in_float32(model_dir):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 30, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", force_cpu=True))
    cuda = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32"))
    assert cuda.worker.device.type == "cuda"
    assert cuda.generate(prompts, params) == cpu.generate(prompts, params)


def test_cuda_memory_limit_bounds_the_kv_cache(model_dir):
    """128M: the decode graphs' reserve (64 MiB of pool slack) plus a KV cache the limit, not
    max_num_seqs, bounds."""
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    small = LLMEngine(EngineConfig(model_path=model_dir, memory_limit=parse_memory_limit("128M")))
    plan = small.worker.kv_plan
    spare_block = plan.kv_bytes_per_token * 16
    assert plan.bound == "limit"
    planned = plan.weights_bytes + plan.activation_bytes + plan.reserved_bytes + plan.kv_budget_bytes + spare_block
    assert planned <= 128 << 20
    assert torch.cuda.memory_allocated() - baseline <= 128 << 20
    with pytest.raises(MemoryBudgetError):
        LLMEngine(EngineConfig(model_path=model_dir, memory_limit=parse_memory_limit("1M")))
