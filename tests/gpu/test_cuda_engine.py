"""CUDA paths: same greedy tokens as the CPU engine, and the memory limit honoured. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from crane_mp.config import EngineConfig, MemoryLimit, parse_memory_limit
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.worker.cache.memory import MemoryBudgetError

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
    """The limit holds the CUDA runtime (context, libraries, allocator slack: measured by a first engine),
    the decode graphs' reserve and a KV cache the limit, not max_num_seqs, bounds, within 128 MiB
    beyond the runtime; torch's allocator is capped at the limit less what lives outside it."""
    probe = LLMEngine(EngineConfig(model_path=model_dir))
    runtime = probe.worker.kv_plan.runtime_bytes
    assert runtime > 0
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    limit = runtime + (128 << 20)
    small = LLMEngine(EngineConfig(model_path=model_dir, memory_limit=MemoryLimit(num_bytes=limit)))
    plan = small.worker.kv_plan
    spare_block = plan.kv_bytes_per_token * 16
    assert plan.bound == "limit"
    planned = (plan.weights_bytes + plan.activation_bytes + plan.reserved_bytes + plan.runtime_bytes
               + plan.kv_budget_bytes + spare_block)
    assert planned <= limit
    assert torch.cuda.memory_allocated() - baseline <= limit - plan.runtime_bytes
    with pytest.raises(MemoryBudgetError):
        LLMEngine(EngineConfig(model_path=model_dir, memory_limit=parse_memory_limit("1M")))
