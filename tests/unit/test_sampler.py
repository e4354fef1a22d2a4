"""Batched sampler: each processor's effect, seeded determinism independent of the batch, logprobs."""

from __future__ import annotations

import math

import torch

from crane_mp.protocol import SamplingParams
from crane_mp.worker.sampler import Sampler, new_sampling_state, record_token

VOCAB = 50
CPU = torch.device("cpu")


def states(*params: SamplingParams, prompt: list[int] | None = None, eos=(1,)):
    return [new_sampling_state(p, prompt or [5, 6], VOCAB, eos, CPU) for p in params]


def peaked_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = peaked_logits(3)
    sampler = Sampler(VOCAB, CPU)
    p = SamplingParams(temperature=0.0, logprobs=3)
    tokens, logprobs = sampler.sample(logits.clone(), states(p, p, p))
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for row, lp in enumerate(logprobs):
        assert math.isclose(lp.logprob, ref[row, tokens[row]].item(), rel_tol=1e-6)
        assert lp.top_token_ids == ref[row].topk(3).indices.tolist()
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_no_logprobs_unless_asked():
    sampler = Sampler(VOCAB, CPU)
    _, logprobs = sampler.sample(peaked_logits(2), states(SamplingParams(temperature=0.0), SamplingParams()))
    assert logprobs == []


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(VOCAB, CPU)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    logits = peaked_logits(1, seed=3) / 3  # flat enough that sampling really varies
    seq_alone, seq_batched = [], []
    st_alone = states(seeded)
    st_batch = states(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7, seed=9))
    for _ in range(20):
        seq_alone.append(sampler.sample(logits.clone(), st_alone)[0][0])
        batch = torch.cat([peaked_logits(1, seed=7), logits, peaked_logits(1, seed=8)])
        seq_batched.append(sampler.sample(batch, st_batch)[0][1])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it is really sampling


def test_top_k_top_p_min_p_restrict_the_support():
    sampler = Sampler(VOCAB, CPU)
    logits = torch.linspace(0, 5, VOCAB)[None, :].repeat(4, 1)  # token 49 most likely, then 48, ...
    params = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.5),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.01),
    ]
    probs = torch.softmax(logits[0], -1)
    top_p_support = int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1
    min_p_support = int((probs >= 0.5 * probs.max()).sum())
    seen = [set() for _ in params]
    st = states(*params)
    for _ in range(200):
        for row, tok in enumerate(sampler.sample(logits.clone(), st)[0]):
            seen[row].add(tok)
    assert seen[0] == {47, 48, 49}
    assert seen[1] <= set(range(VOCAB - top_p_support, VOCAB)) and len(seen[1]) > 1
    assert seen[2] == set(range(VOCAB - min_p_support, VOCAB))
    assert seen[3] == {49}


def test_penalties_follow_vllm_definitions():
    sampler = Sampler(VOCAB, CPU)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.0  # in the prompt, positive
    logits[0, 6] = -2.0  # in the prompt, negative
    logits[0, 7] = 1.5  # generated twice
    st = states(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    record_token(st[0], 7)
    record_token(st[0], 7)
    processed = sampler._apply_processors(logits.clone(), st)[0]
    assert processed[5].item() == 1.0  # 2 / 2
    assert processed[6].item() == -4.0  # -2 * 2
    assert math.isclose(processed[7].item(), 1.5 / 2 - 0.5 * 2 - 0.25)
    assert processed[8].item() == 0.0  # untouched


def test_logit_bias_and_min_tokens_suppression():
    sampler = Sampler(VOCAB, CPU)
    logits = peaked_logits(1)
    favourite = int(logits.argmin())
    st = states(SamplingParams(temperature=0.0, logit_bias={favourite: 100.0}))
    assert sampler.sample(logits.clone(), st)[0] == [favourite]

    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = 10.0  # eos
    logits[0, 9] = 9.0  # a stop token id
    st = states(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]))
    assert sampler.sample(logits.clone(), st)[0] != [1]
    assert sampler.sample(logits.clone(), st)[0] not in ([1], [9])
    record_token(st[0], 3)
    record_token(st[0], 3)
    assert sampler.sample(logits.clone(), st)[0] == [1]  # min_tokens reached: EOS allowed again


def test_temperature_changes_the_spread():
    sampler = Sampler(VOCAB, CPU)
    logits = peaked_logits(1, seed=5) / 3
    cold = states(SamplingParams(temperature=0.05, seed=1))
    hot = states(SamplingParams(temperature=5.0, seed=1))
    cold_seen = {sampler.sample(logits.clone(), cold)[0][0] for _ in range(50)}
    hot_seen = {sampler.sample(logits.clone(), hot)[0][0] for _ in range(50)}
    assert cold_seen == {int(logits.argmax())}
    assert len(hot_seen) > 10
