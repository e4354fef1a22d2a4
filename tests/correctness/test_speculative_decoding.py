"""Speculative decoding changes no token: greedy, seeded-sampling (with penalties and logprobs),
stop-token and grammar-constrained requests give the tokens they give without it, with each proposer
(n-gram, a draft that always agrees, a draft that rarely does), in mixed batches under preemption."""

from __future__ import annotations

import pytest
import torch
from llguidance import LLMatcher

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=3))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The same tokenizer, other weights: a draft whose proposals the target mostly rejects."""
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("d") / "qwen3", seed=11))


def engine(model_dir: str, **kwargs) -> LLMEngine:
    # float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one.
    return LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", kv_cache_dtype="float32", force_cpu=True,
                                  max_model_len=128, max_total_tokens=160, max_num_seqs=16, **kwargs))


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    # Half of them repeat a phrase, as the inputs an n-gram proposer pays off on do.
    out = []
    for i in range(n):
        words = torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=gen)),), generator=gen).tolist()
        out.append(words * 2 if i % 2 else words)
    return out


def mixed_params(n: int, stop_ids: list[int]) -> list[SamplingParams]:
    regex = LLMatcher.grammar_from_regex(r"(yes|no)-[0-9]{2,3}")
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, min_tokens=4))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_ids[i]], ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=24, repetition_penalty=1.2,
                                         logprobs=3, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, grammar=regex))
    return params


def run(eng: LLMEngine, batch: list[list[int]], params: list[SamplingParams]):
    ids = [eng.add_request(p, s) for p, s in zip(batch, params)]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    while eng.has_work:
        for out in eng.step():
            tokens[out.rid] += out.new_token_ids
            logprobs[out.rid] += out.logprobs
    assert eng.scheduler.num_free_blocks == eng.worker.kv_plan.num_blocks
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


@pytest.fixture(scope="module")
def workload(model_dir):
    batch = prompts(16)
    # Stop ids the greedy requests do meet: each one's 6th token without a stop.
    free = engine(model_dir).generate(batch, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = mixed_params(len(batch), [out[5] for out in free])
    return batch, params, run(engine(model_dir), batch, params)


@pytest.mark.parametrize("method", ["ngram", "agreeing-draft", "other-draft"])
def test_every_request_gains_the_tokens_it_gains_without_speculation(model_dir, other_model, workload, method):
    batch, params, (want, want_logprobs) = workload
    options = {"ngram": dict(speculative_method="ngram"),
               "agreeing-draft": dict(speculative_method="draft", speculative_model=model_dir),
               "other-draft": dict(speculative_method="draft", speculative_model=other_model)}[method]
    eng = engine(model_dir, speculative_num_tokens=4, speculative_disable_batch_size=32, **options)
    got, got_logprobs = run(eng, batch, params)
    assert got == want
    assert eng.scheduler.num_preemptions > 0  # 160 KV tokens do not hold 16 requests at once
    for row, (mine, theirs) in enumerate(zip(got_logprobs, want_logprobs)):
        if params[row].logprobs is not None:
            assert [lp.top_token_ids for lp in mine] == [lp.top_token_ids for lp in theirs]
            torch.testing.assert_close([lp.logprob for lp in mine], [lp.logprob for lp in theirs], atol=1e-4, rtol=0)
    for row, p in enumerate(params):
        if p.stop_token_ids:
            assert got[row][-1] == p.stop_token_ids[0]  # each met its stop token and ended there
    counters = eng.scheduler.spec.counters
    assert counters.draft_tokens > 0
    if method == "agreeing-draft":
        # Every proposal is the target's own greedy choice; sampled rows reject some.
        assert counters.accepted_tokens > 0.5 * counters.draft_tokens, counters
    elif method == "other-draft":
        assert counters.accepted_tokens < 0.2 * counters.draft_tokens, counters


def test_proposals_over_a_long_context_verified_as_one_span_gain_the_same_tokens(model_dir, workload, monkeypatch):
    """Past a context length the proposals are verified as one span of the decode row's sequence (its keys
    read once) rather than decode rows of their own: the tokens are those without speculation still."""
    from crane_mp.worker.step import runner

    monkeypatch.setattr(runner, "_PROPOSAL_DECODE_CONTEXT", 0)
    batch, params, (want, _) = workload
    eng = engine(model_dir, speculative_num_tokens=4, speculative_disable_batch_size=32,
                 speculative_method="draft", speculative_model=model_dir)
    assert run(eng, batch, params)[0] == want
    assert eng.scheduler.spec.counters.accepted_tokens > 0
