"""Speculative decoding on CUDA: with each proposer, greedy, seeded-sampling, stop-token and grammar requests
gain the tokens they gain without it, in float32, the plain steps replayed from the decode graphs and the
proposals verified as one span of 1+K query rows through the Triton attention, under preemption.
Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from tests.correctness.test_speculative_decoding import mixed_params, prompts, run
from tests.gpu.test_cuda_paths import SHAPE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The target, and a draft with the same tokenizer and other weights (its proposals mostly rejected)."""
    root = tmp_path_factory.mktemp("spec")
    return (str(make_model("qwen3", "tiny", root / "target", seed=3, overrides=SHAPE)),
            str(make_model("qwen3", "tiny", root / "other", seed=11, overrides=SHAPE)))


def engine(model_dir: str, **kwargs) -> LLMEngine:
    gc.collect()
    torch.cuda.empty_cache()
    # 192 KV tokens make every proposer preempt on this checkpoint (seen on CPU with the same tokens: 2, 1
    # and 2 preemptions); at 160 the agreeing draft's requests ended before the cache ran out (H200, 2026-11-30).
    return LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", kv_cache_dtype="float32", max_model_len=128,
                                  max_total_tokens=192, max_num_seqs=16, **kwargs))


@pytest.fixture(scope="module")
def workload(checkpoints):
    batch = prompts(16)
    free = engine(checkpoints[0]).generate(batch, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = mixed_params(len(batch), [out[5] for out in free])
    return batch, params, run(engine(checkpoints[0]), batch, params)


@pytest.mark.parametrize("method", ["ngram", "agreeing-draft", "other-draft"])
def test_every_request_gains_its_tokens_without_speculation_on_cuda(checkpoints, workload, method):
    target, other = checkpoints
    batch, params, (want, want_logprobs) = workload
    options = {"ngram": dict(speculative_method="ngram"),
               "agreeing-draft": dict(speculative_method="draft", speculative_model=target),
               "other-draft": dict(speculative_method="draft", speculative_model=other)}[method]
    eng = engine(target, speculative_num_tokens=4, speculative_disable_batch_size=32, **options)
    assert eng.worker.device.type == "cuda" and eng.worker.runner.decode_graphs is not None
    got, got_logprobs = run(eng, batch, params)
    assert got == want
    assert eng.scheduler.num_preemptions > 0
    for row, (mine, theirs) in enumerate(zip(got_logprobs, want_logprobs)):
        if params[row].logprobs is not None:
            assert [lp.top_token_ids for lp in mine] == [lp.top_token_ids for lp in theirs]
            torch.testing.assert_close([lp.logprob for lp in mine], [lp.logprob for lp in theirs], atol=1e-3, rtol=0)
    counters = eng.scheduler.spec.counters
    assert counters.draft_tokens > 0
    if method == "agreeing-draft":
        assert counters.accepted_tokens > 0.5 * counters.draft_tokens, counters
