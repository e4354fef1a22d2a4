"""Decode graphs: batch-size buckets, and the static-buffer plumbing (padding, the spare KV block, one
copy per step) checked on CPU by replaying the captured forward eagerly: greedy and seeded tokens must
equal the eager engine's for batch sizes between buckets, and under preemption. The capture itself
(torch.cuda.CUDAGraph) runs only on a GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.worker.step.decode_graphs import bucket_for, graph_batch_sizes


def test_buckets_cover_every_batch_up_to_the_largest():
    assert graph_batch_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(5000)[-1] == 256
    sizes = graph_batch_sizes(100)
    for batch in range(1, 101):
        bucket = bucket_for(batch, sizes)
        assert bucket >= batch and bucket - batch < 8
    assert bucket_for(101, sizes) is None


class EagerReplay:
    """Stands in for a captured CUDA graph on CPU: replays the forward over the same static buffers."""

    def __init__(self, forward, pool) -> None:
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=6))


def engine(model_dir: str, graphs: bool, **kwargs) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", force_cpu=True, max_num_seqs=12, **kwargs))
    if eng.worker.runner.attention_backend == "torch":
        pytest.skip("decode graphs need the native or Triton attention kernel")
    if graphs:
        eng.worker.runner.enable_decode_graphs(graph_batch_sizes(12), capture=EagerReplay)
    return eng


def test_replayed_decodes_equal_eager_ones_between_buckets_and_under_preemption(model_dir):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 40, 17, 9, 33, 21, 5, 12, 28, 2, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    eager = engine(model_dir, graphs=False, max_total_tokens=256)
    replayed = engine(model_dir, graphs=True, max_total_tokens=256)
    calls = []
    graphs = replayed.worker.runner.decode_graphs
    original_run = graphs.run
    graphs.run = lambda decodes, *args: calls.append(len(decodes)) or original_run(decodes, *args)

    assert replayed.generate(prompts, params) == eager.generate(prompts, params)
    assert replayed.scheduler.num_preemptions > 0
    assert set(calls) - set(graphs.sizes), "no batch between two buckets was replayed"
    # Padded rows wrote only the spare block, which the scheduler never hands out.
    spare = replayed.worker.runner.num_blocks
    assert replayed.worker.kv_plan.num_blocks == spare
    assert replayed.worker.runner.model.attention_layers()[0].k_cache[spare].abs().sum() > 0


# Gemma 4 with global rows twice as wide as the sliding ones': the sliding group's ids are scaled.
@pytest.mark.parametrize(("family", "overrides"), [("gemma3_text", {}), ("gemma4_text", {"global_head_dim": 64})])
def test_replayed_decodes_read_each_kv_group_s_own_tables(tmp_path, family, overrides):
    """A Gemma 3 or 4 keeps its sliding layers in KV groups of their own (6-token windows the prompts
    cross): each group's slots and block tables go through the graph's static buffers."""
    from crane_mp.testing.make_zoo import make_zoo_model

    path = str(make_zoo_model(family, tmp_path / family, overrides=overrides))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = engine(path, graphs=False, max_total_tokens=384, kv_cache_dtype="float32")
    replayed = engine(path, graphs=True, max_total_tokens=384, kv_cache_dtype="float32")
    assert len(replayed.worker.runner.kv_groups.windows) > 1
    calls = []
    graphs = replayed.worker.runner.decode_graphs
    original_run = graphs.run
    graphs.run = lambda decodes, *args: calls.append(len(decodes)) or original_run(decodes, *args)
    assert replayed.generate(prompts, params) == eager.generate(prompts, params)
    assert calls and replayed.scheduler.num_free_blocks == replayed.worker.kv_plan.num_blocks
