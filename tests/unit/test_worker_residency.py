"""The worker's side of sleep and new weights, in-process on a tiny model: what each sleep level frees,
that a wake-up computes the same logits, and that new weights replace the old only when their shapes fit."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.testing.make_model import make_model
from crane_mp.worker.bootstrap import load_worker
from crane_mp.worker.residency import Residency, WeightsError
from tests.model_helpers import prefill_span

PROMPT = [5, 17, 42, 99, 7, 13, 200, 31]


def _config(path) -> EngineConfig:
    return EngineConfig(model_path=str(path), dtype="float32", max_model_len=64, max_total_tokens=256,
                        max_num_seqs=4, max_num_batched_tokens=64)


def _logits(residency: Residency) -> torch.Tensor:
    runner = residency.runner
    with torch.inference_mode():
        hidden = runner.forward([], [prefill_span(runner, len(PROMPT))], PROMPT, list(range(len(PROMPT))))
        return runner.model.compute_logits(hidden).float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return (make_model("qwen3", "tiny", root / "old", seed=4), make_model("qwen3", "tiny", root / "new", seed=5),
            make_model("qwen3", "tiny", root / "deeper", seed=4, overrides={"num_hidden_layers": 3}))


@pytest.fixture
def residency(checkpoints):
    config = _config(checkpoints[0])
    return Residency(config, load_worker(config, progress=False))


def test_level_one_frees_the_kv_cache_and_the_wake_computes_the_same_logits(residency):
    before = _logits(residency)
    residency.sleep(1)
    assert all(attn.k_cache is None and attn.v_cache is None for attn in residency.runner.model.attention_layers())
    residency.wake()
    assert residency.sleep_level == 0 and residency.runner.num_blocks == residency.loaded.kv_plan.num_blocks
    torch.testing.assert_close(_logits(residency), before, rtol=0, atol=0)


def test_level_two_drops_the_weights_and_the_wake_reads_them_again(residency):
    before = _logits(residency)
    old_runner = residency.runner
    residency.sleep(2)
    assert residency.runner.model is None and residency.sleep_level == 2
    residency.wake()
    assert residency.runner is not old_runner and residency.sleep_level == 0
    torch.testing.assert_close(_logits(residency), before, rtol=0, atol=0)


def test_new_weights_replace_the_old_and_compute_as_a_fresh_load(residency, checkpoints):
    before = _logits(residency)
    residency.stage(str(checkpoints[1]))
    torch.testing.assert_close(_logits(residency), before, rtol=0, atol=0)  # read beside: the old still serve
    assert residency.swap() == str(checkpoints[1]) and residency.weights_path == str(checkpoints[1])
    fresh = Residency(_config(checkpoints[1]), load_worker(_config(checkpoints[1]), progress=False))
    after = _logits(residency)
    torch.testing.assert_close(after, _logits(fresh), rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_weights_of_another_shape_are_refused_and_the_old_keep_serving(residency, checkpoints):
    before = _logits(residency)
    with pytest.raises(WeightsError, match="num_hidden_layers 3"):
        residency.stage(str(checkpoints[2]))
    with pytest.raises(WeightsError, match="no new weights"):
        residency.swap()
    torch.testing.assert_close(_logits(residency), before, rtol=0, atol=0)
