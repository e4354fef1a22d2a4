"""Speculative decoding on a hybrid target (Qwen3.5, Qwen3-Next): its linear-attention layers verify a
sequence's proposals as decode steps on copies of its state, and keep only the rows whose tokens it
keeps. A proposer that is mostly right and sometimes wrong at each depth, in batches under preemption,
with greedy and seeded requests, changes no token."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_zoo import make_zoo_model
from crane_mp.worker.speculative.ngram import NgramProposer


def engine(path, total_tokens: int, **kwargs) -> LLMEngine:
    # float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one.
    return LLMEngine(EngineConfig(model_path=str(path), dtype="float32", kv_cache_dtype="float32", force_cpu=True,
                                  max_model_len=128, max_total_tokens=total_tokens, max_num_seqs=8, **kwargs))


class Oracle(NgramProposer):
    """Proposes each sequence's known continuation, one proposal in three steps made wrong."""

    def __init__(self, sequences: list[list[int]]) -> None:
        super().__init__(1, 1)
        self.sequences, self.calls = sequences, 0

    def propose(self, batch):
        out = {}
        for req_id, tokens, _, wanted in batch:
            known = next((s for s in self.sequences if s[: len(tokens)] == tokens), [])
            proposal = known[len(tokens) : len(tokens) + wanted]
            self.calls += 1
            if proposal and self.calls % 3 == 0:
                proposal[self.calls % len(proposal)] = 7
            out[req_id] = proposal
        return out


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("total_tokens", [1024, 160])
def test_a_hybrid_verifies_proposals_without_changing_a_token(tmp_path, family, total_tokens):
    path = make_zoo_model(family, tmp_path / family, seed=2)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 33, 9, 12, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]

    def run(eng: LLMEngine) -> list[list[int]]:
        ids = [eng.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        tokens = {i: [] for i in ids}
        while eng.has_work:
            for out in eng.step():
                tokens[out.rid] += out.new_token_ids
        return [tokens[i] for i in ids]

    want = run(engine(path, total_tokens))
    eng = engine(path, total_tokens, speculative_method="ngram", speculative_num_tokens=3,
                 speculative_disable_batch_size=32)
    eng.worker.runner.proposer = Oracle([prompt + out for prompt, out in zip(prompts, want)])
    assert run(eng) == want
    counters = eng.scheduler.spec.counters
    # Some proposals kept at every depth, some rejected: both ways through the state commit.
    assert all(counters.accepted_per_position) and counters.accepted_tokens < counters.draft_tokens, counters
    if total_tokens == 160:
        assert eng.scheduler.num_preemptions > 0
