"""Batched sampler: each processor's effect, seeded determinism independent of the batch, logprobs."""

from __future__ import annotations

import math

import msgspec
import torch

from crane_mp.protocol import SamplingParams, ThinkingBudget
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.sampling.sampler import Sampler
from crane_mp.worker.sampling.seeded_noise import row_keys, uniform_from_keys

VOCAB = 50
CPU = torch.device("cpu")
CPU_PLATFORM = platform_for(CPU)


def states(sampler: Sampler, *params: SamplingParams, prompt: list[int] | None = None, eos=(1,)):
    return [sampler.new_state(p, prompt or [5, 6], eos) for p in params]


def draw(sampler: Sampler, logits: torch.Tensor, st) -> list[int]:
    """Sample one step and record it, as the runner does."""
    tokens = sampler.sample(logits, st)[0]
    sampler.record(st, tokens)
    return tokens


def peaked_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = peaked_logits(3)
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    p = SamplingParams(temperature=0.0, logprobs=3)
    tokens, logprobs = sampler.sample(logits.clone(), states(sampler, p, p, p))
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for row, lp in enumerate(logprobs):
        assert math.isclose(lp.logprob, ref[row, tokens[row]].item(), rel_tol=1e-6)
        assert lp.top_token_ids == ref[row].topk(3).indices.tolist()
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_no_logprobs_unless_asked():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    _, logprobs = sampler.sample(peaked_logits(2), states(sampler, SamplingParams(temperature=0.0), SamplingParams()))
    assert logprobs == []


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    logits = peaked_logits(1, seed=3) / 3  # flat enough that sampling really varies
    seq_alone, seq_batched = [], []
    st_alone = states(sampler, seeded)
    st_batch = states(sampler, SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7, seed=9))
    for _ in range(20):
        seq_alone.append(draw(sampler, logits.clone(), st_alone)[0])
        batch = torch.cat([peaked_logits(1, seed=7), logits, peaked_logits(1, seed=8)])
        seq_batched.append(draw(sampler, batch, st_batch)[1])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it is really sampling


def test_top_k_top_p_min_p_restrict_the_support():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
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
    st = states(sampler, *params)
    for _ in range(200):
        for row, tok in enumerate(sampler.sample(logits.clone(), st)[0]):
            seen[row].add(tok)
    assert seen[0] == {47, 48, 49}
    assert seen[1] <= set(range(VOCAB - top_p_support, VOCAB)) and len(seen[1]) > 1
    assert seen[2] == set(range(VOCAB - min_p_support, VOCAB))
    assert seen[3] == {49}


def test_penalties_follow_vllm_definitions():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.0  # in the prompt, positive
    logits[0, 6] = -2.0  # in the prompt, negative
    logits[0, 7] = 1.5  # generated twice
    st = states(sampler, SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    sampler.record(st, [7])
    sampler.record(st, [7])
    processed = sampler._apply_processors(logits.clone(), st)[0]
    assert processed[5].item() == 1.0  # 2 / 2
    assert processed[6].item() == -4.0  # -2 * 2
    assert math.isclose(processed[7].item(), 1.5 / 2 - 0.5 * 2 - 0.25)
    assert processed[8].item() == 0.0  # untouched


def test_logit_bias_and_min_tokens_suppression():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    logits = peaked_logits(1)
    favourite = int(logits.argmin())
    st = states(sampler, SamplingParams(temperature=0.0, logit_bias={favourite: 100.0}))
    assert sampler.sample(logits.clone(), st)[0] == [favourite]

    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = 10.0  # eos
    logits[0, 9] = 9.0  # a stop token id
    st = states(sampler, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]))
    assert sampler.sample(logits.clone(), st)[0] != [1]
    assert sampler.sample(logits.clone(), st)[0] not in ([1], [9])
    sampler.record(st, [3])
    sampler.record(st, [3])
    assert sampler.sample(logits.clone(), st)[0] == [1]  # min_tokens reached: EOS allowed again


def test_temperature_changes_the_spread():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    logits = peaked_logits(1, seed=5) / 3
    cold = states(sampler, SamplingParams(temperature=0.05, seed=1))
    hot = states(sampler, SamplingParams(temperature=5.0, seed=1))
    cold_seen = {draw(sampler, logits.clone(), cold)[0] for _ in range(50)}
    hot_seen = {draw(sampler, logits.clone(), hot)[0] for _ in range(50)}
    assert cold_seen == {int(logits.argmax())}
    assert len(hot_seen) > 10


def test_seeded_uniforms_are_a_function_of_seed_and_position():
    seeds = [7, 7, 8, -(2**63), 2**63 - 1]
    uniform = uniform_from_keys(row_keys(seeds, [0, 1, 0, 0, 0], CPU))
    assert len(set(uniform.tolist())) == 5
    assert uniform_from_keys(row_keys([7], [0], CPU)).item() == uniform[0].item()
    many = uniform_from_keys(row_keys([3] * 20000, list(range(20000)), CPU))
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.003
    assert abs(torch.corrcoef(torch.stack([many[:-1], many[1:]]))[0, 1].item()) < 0.03


def test_draws_follow_the_truncated_distribution_also_past_the_candidates():
    """Empirical frequencies against vLLM's definitions: top_k, renormalise, top_p, for a peaked row and
    a flat one whose top_p set holds most of the vocabulary."""
    vocab = 200
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, vocab, generator=gen) * 1.5
    flat = torch.randn(1, vocab, generator=gen) * 0.05  # nearly uniform, no ties: top_p 0.9 keeps ~180 tokens
    cases = [(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.8)),
             (flat, SamplingParams(temperature=1.0, top_p=0.9))]
    sampler = Sampler(vocab, CPU_PLATFORM)
    for row_logits, p in cases:
        probs = torch.softmax(row_logits[0] / p.temperature, -1)
        ordered, order = probs.sort(descending=True)
        if p.top_k:
            ordered = ordered[: p.top_k]
        ordered = ordered / ordered.sum()
        keep = (ordered.cumsum(0) - ordered) < p.top_p
        want = torch.zeros(vocab)
        want[order[: len(ordered)][keep]] = ordered[keep] / ordered[keep].sum()
        st = states(sampler, *[msgspec.structs.replace(p, seed=row) for row in range(100)])  # deterministic rows
        counts = torch.zeros(vocab)
        for _ in range(200):
            for token in draw(sampler, row_logits.repeat(100, 1), st):
                counts[token] += 1
        assert set(counts.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist())
        total_variation = 0.5 * (counts / counts.sum() - want).abs().sum().item()
        assert total_variation < 0.06, total_variation  # ~0.04 expected from 20,000 draws


def reference_processors(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
                         prompt: list[int], eos: tuple[int, ...]) -> torch.Tensor:
    """One row at a time, straight from vLLM's definitions."""
    out = logits.clone()
    for row, (p, generated) in enumerate(zip(params, outputs)):
        for token, bias in (p.logit_bias or {}).items():
            out[row, token] += bias
        if len(generated) < p.min_tokens:  # the sampler's finite stand-in for -inf
            for token in list(p.stop_token_ids) + list(eos):
                out[row, token] -= 1e30
        if p.uses_penalties:
            for token in set(prompt) | set(generated):
                value = out[row, token]
                out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            for token in set(generated):
                out[row, token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return out


def test_batched_processors_equal_a_row_by_row_reference_across_steps():
    gen = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 40: -2.5}),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=0.7, min_tokens=3, stop_token_ids=[4],
                       logit_bias={4: 1.0, 9: 0.5}),
        SamplingParams(temperature=0.0, repetition_penalty=0.8),
    ]
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    st = states(sampler, *params, prompt=[5, 6, 6, 12])
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(6):
        logits = torch.randn(len(params), VOCAB, generator=gen)
        want = reference_processors(logits, params, outputs, [5, 6, 6, 12], (1,))
        torch.testing.assert_close(sampler._apply_processors(logits.clone(), st), want, rtol=1e-6, atol=1e-6)
        tokens = torch.randint(0, 12, (len(params),), generator=gen).tolist()  # repeats across rows and steps
        sampler.record(st, tokens)
        for row, token in enumerate(tokens):
            outputs[row].append(token)


def test_penalty_rows_are_reused_after_release_and_the_table_grows():
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    first = states(sampler, *[penalised] * 9)  # more than the first allocation of 8 rows
    assert len({s.penalty_row for s in first}) == 9
    sampler.record(first, [2] * 9)
    freed_row = first[0].penalty_row
    sampler.release(first[0])
    reused = states(sampler, penalised)[0]
    assert reused.penalty_row == freed_row
    logits = torch.zeros(1, VOCAB)
    assert sampler._apply_processors(logits.clone(), [reused])[0, 2].item() == 0.0  # no counts carried over
    assert sampler._apply_processors(logits.clone(), [first[1]])[0, 2].item() == -1.0


def test_passes_and_the_whole_vocabulary_redo_match_one_pass(monkeypatch):
    """A batch split into passes (bounded [rows, vocabulary] memory) draws what one pass draws; flat top_p
    rows whose kept set is wider than the candidates draw again from the whole vocabulary (from the
    caller's logits, which passes with such rows leave as they were), their logprob taken for the token
    finally drawn."""
    vocab = 1000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, vocab, generator=gen) * 3
    flat_rows = [2, 5]
    for row in flat_rows:  # top_p 0.95 keeps ~950 tokens, past the 256 candidates
        logits[row] = torch.randn(vocab, generator=gen) * 0.01
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, top_k=30, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.95, logprobs=3), SamplingParams(temperature=0.7, seed=4),
              SamplingParams(temperature=0.8, min_p=0.1, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, top_p=0.95, seed=9, logprobs=1), SamplingParams(temperature=0.0)]
    redone: list[list[int]] = []

    def run(rows_per_pass: int | None):
        torch.manual_seed(0)  # both samplers' unseeded rows draw the same uniforms
        sampler = Sampler(vocab, CPU_PLATFORM)
        original = sampler._redo
        monkeypatch.setattr(sampler, "_redo", lambda *a: redone.append(list(a[3])) or original(*a))
        if rows_per_pass:
            monkeypatch.setattr(sampler, "rows_per_pass", lambda: rows_per_pass)
        before = logits.clone()
        out = sampler.sample(logits, states(sampler, *params))
        assert torch.equal(logits, before)
        return out

    tokens, logprobs = run(None)
    assert (tokens, logprobs) == run(2)
    assert redone == [flat_rows, flat_rows]
    # The seeded flat row, from the definitions: sort the whole row, keep the top_p prefix, invert its CDF.
    ordered, order = torch.softmax(logits[5], -1).sort(descending=True)
    kept = ordered * ((ordered.cumsum(0) - ordered) < 0.95)
    cdf = kept.cumsum(0)
    u = uniform_from_keys(row_keys([9], [0], CPU))[0]
    assert tokens[5] == order[torch.searchsorted(cdf, u * cdf[-1], right=True)].item()
    raw = torch.log_softmax(logits, -1)
    for row, lp in enumerate(logprobs):
        if params[row].logprobs is None:
            assert lp is None
            continue
        assert math.isclose(lp.logprob, raw[row, tokens[row]].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert lp.top_token_ids == raw[row].topk(params[row].logprobs).indices.tolist()


def test_a_cdf_summed_out_of_order_never_draws_a_zero_probability_entry():
    """CUDA's one-row scan can step the CDF an ulp across a zero entry, up or down; flat_at_zeros
    undoes that, so every target lands on an entry with probability."""
    from crane_mp.worker.sampling.sampler import flat_at_zeros

    probs = torch.tensor([[0.25, 0.0, 0.25, 0.0, 0.0, 0.5, 0.0]])
    exact = probs.cumsum(-1)
    ulp = 2.0 ** -24
    skewed = exact + torch.tensor([[0.0, ulp, 0.0, -ulp, ulp, 0.0, -ulp]])  # as thread boundaries may
    cdf = flat_at_zeros(probs, skewed)
    assert torch.all(cdf[:, 1:] >= cdf[:, :-1])
    zeros = (probs == 0).nonzero()[:, 1]
    assert torch.equal(cdf[0, zeros], cdf[0, zeros - 1])
    targets = torch.cat([skewed[0], skewed[0] - ulp, torch.linspace(0, 0.999, 101)]).clamp(0, cdf[0, -1] - ulp)
    drawn = torch.searchsorted(cdf.expand(len(targets), -1).contiguous(), targets[:, None], right=True)
    assert torch.all(probs[0, drawn.squeeze(1)] > 0)
    unflattened = torch.searchsorted(skewed.expand(len(targets), -1).contiguous(), targets[:, None], right=True)
    assert torch.any(probs[0, unflattened.squeeze(1)] == 0)  # what the skew does without the fix


def test_a_thinking_budget_forces_the_end_of_thinking_once():
    think, end = 40, 41
    sampler = Sampler(VOCAB, CPU_PLATFORM)
    answer_opens = SamplingParams(seed=1, thinking=ThinkingBudget(3, think, end))
    prompt_opens = SamplingParams(temperature=0.0, thinking=ThinkingBudget(2, think, end, opened=True))
    no_think = SamplingParams(seed=2, thinking=ThinkingBudget(0, think, end))
    st = states(sampler, answer_opens, prompt_opens, no_think)
    out = [[] for _ in st]
    for step in range(8):
        logits = peaked_logits(3, seed=step)
        logits[:, end] = -50.0  # the model would never close its thinking
        logits[:, think] = -50.0
        if step == 0:
            logits[0, think] = 50.0  # the first answer opens with <think>
        for row, token in enumerate(draw(sampler, logits, st)):
            out[row].append(token)
    assert out[0][0] == think and out[0][4] == end and end not in out[0][5:]  # 3 thoughts, then forced
    assert out[1][2] == end and end not in out[1][3:]  # the prompt opened it: 2 thoughts
    assert end not in out[2]  # never thought: nothing forced
