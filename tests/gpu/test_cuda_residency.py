"""Sleep and wake-up on CUDA: level 1 moves the weights to host memory and frees the KV cache, level 2 drops
the weights; after either wake the decode graphs are captured again over the new cache and greedy tokens
are those before the sleep. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.worker.residency import Residency
from tests.gpu.test_cuda_paths import SHAPE, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=8, overrides=SHAPE))


def device_bytes(runner) -> int:
    """What the weights and the KV cache hold on the device."""
    weights = sum(t.numel() * t.element_size() for t in [*runner.model.parameters(), *runner.model.buffers()]
                  if t.is_cuda)
    return weights + runner.num_blocks * runner.block_size * runner.kv_bytes_per_token()


@pytest.mark.parametrize("level", [1, 2])
def test_a_wake_gives_the_tokens_before_the_sleep_through_new_decode_graphs(model_dir, level):
    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", max_model_len=1024, max_total_tokens=4096,
                                 max_num_seqs=8, enable_prefix_caching=False))
    batch = prompts([300, 45, 1, 129, 17, 64])
    want = eng.generate(batch, GREEDY)
    residency = Residency(eng.config, eng.worker)
    sizes = list(eng.worker.runner.decode_graphs.sizes)
    held, resident = torch.cuda.memory_allocated(), device_bytes(eng.worker.runner)
    residency.sleep(level)
    assert held - torch.cuda.memory_allocated() >= resident
    residency.wake()
    graphs = eng.worker.runner.decode_graphs
    assert graphs is not None and list(graphs.sizes) == sizes
    assert eng.generate(batch, GREEDY) == want
    assert eng.scheduler.num_free_blocks == eng.worker.kv_plan.num_blocks
