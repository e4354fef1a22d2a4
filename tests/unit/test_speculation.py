"""Speculative decoding without a model: the n-gram proposer, and the scheduler's side (lookahead blocks,
several tokens a step, pacing by acceptance), driven by the fake worker, whose KV check fails a test
that reads a rejected proposal's KV or loses an accepted one."""

from __future__ import annotations

import pytest

from crane_mp.protocol import DraftOutcome, StepResult
from crane_mp.scheduler.speculation import Speculation
from crane_mp.worker.speculative.ngram import propose_ngram
from tests.factories import FakeWorker, make_requests, make_scheduler, run_to_completion


def test_ngram_copies_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # The last 3 tokens (5, 2, 3) never occurred before; (2, 3) did, twice: the latest is followed by 7, 8.
    assert propose_ngram(tokens, 3, 2, 3) == [7, 8, 5]
    assert propose_ngram(tokens, 1, 2, 3) == [7]
    assert propose_ngram([4, 5, 6, 4, 5, 6, 4, 5], 4, 2, 4) == [6, 4, 5]  # a match overlapping the suffix
    assert propose_ngram([1, 2, 3, 4], 3, 2, 3) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 3, 2, 1], 2, 3, 3) == []  # (3, 2, 1) never repeats; 2-grams not allowed
    assert propose_ngram([1, 2, 1, 3, 2, 1], 2, 2, 3) == [3, 2]  # (2, 1) did, followed by 3
    assert propose_ngram([7, 7], 4, 2, 3) == []  # too short to hold a match and its continuation
    assert propose_ngram([5, 5, 5, 5], 0, 1, 2) == []


def _repeat_proposer(tokens, k):
    """What the fake worker samples next is a function of the whole history: proposals that copy the
    n-gram proposer's choice agree now and then, and disagree the rest."""
    return propose_ngram(tokens, k, 1, 3)


def _oracle(worker: FakeWorker):
    """A proposer that always agrees: the fake worker's own next tokens."""

    def propose(tokens, k):
        seq, out = list(tokens), []
        for _ in range(k):
            out.append(worker._next_token(-1, seq))
            seq.append(out[-1])
        return out

    return propose


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["oracle", "ngram", "never"])
def test_speculation_gives_the_same_tokens_in_fewer_steps_under_preemption(which, overlap):
    lengths = [5 + 3 * i for i in range(10)]
    plain = make_scheduler(num_blocks=40, max_model_len=64)
    for req in make_requests(10, prompt_len=lengths, max_tokens=20):
        plain.add_request(req)
    plain_worker = FakeWorker()
    want = run_to_completion(plain, plain_worker, overlap=overlap)

    sched = make_scheduler(num_blocks=40, max_model_len=64, num_speculative_tokens=3,
                           speculative_disable_batch_size=16)
    for req, twin in zip(make_requests(10, prompt_len=lengths, max_tokens=20), sorted(want)):
        req.req_id = twin + 10_000  # the same prompts as the plain run's, by the same order of ids
        sched.add_request(req)
    worker = FakeWorker()
    worker.propose = {"oracle": _oracle(worker), "ngram": _repeat_proposer,
                      "never": lambda tokens, k: [0] * k}[which]
    got = run_to_completion(sched, worker, overlap=overlap)
    assert {rid - 10_000: tokens for rid, tokens in got.items()} == want
    assert sched.num_preemptions > 0  # 40 blocks of 4 tokens do not hold ten requests at once
    proposed = sum(o.proposed for o in worker.outcomes)
    accepted = sum(o.accepted for o in worker.outcomes)
    counters = sched.spec.counters
    assert (counters.draft_tokens, counters.accepted_tokens) == (proposed, accepted) and proposed > 0
    if which == "oracle":
        assert accepted == proposed and len(worker.plans) < len(plain_worker.plans)
    if which == "never":
        assert accepted == 0


def test_lookahead_holds_blocks_and_stops_at_max_tokens():
    sched = make_scheduler(num_blocks=64, num_speculative_tokens=4)
    [req] = make_requests(1, prompt_len=4, max_tokens=3)
    sched.add_request(req)
    worker = FakeWorker()
    worker.propose = _oracle(worker)
    sched.update(worker.execute(sched.schedule()))  # the prompt: no lookahead, one token
    plan = sched.schedule()
    [row] = plan.scheduled
    # Two tokens are left: this row samples one and may propose one more, not four.
    assert (row.num_new_tokens, row.num_lookahead) == (1, 1)
    assert len(req.block_ids) * 4 >= req.num_computed_tokens + row.num_lookahead
    assert sched.speculating and sched.schedule() is None  # nothing planned ahead of it
    outputs = sched.update(worker.execute(plan))
    assert outputs[0].new_token_ids == req.output_ids[1:] and len(req.output_ids) == 3
    assert outputs[0].finish_reason is not None and not sched.running


def test_a_stop_token_among_accepted_tokens_ends_the_request_there():
    sched = make_scheduler(num_blocks=64, num_speculative_tokens=4)
    [req] = make_requests(1, prompt_len=4, max_tokens=16)
    sched.add_request(req)
    worker = FakeWorker()
    sched.update(worker.execute(sched.schedule()))
    plan = sched.schedule()
    assert plan.scheduled[0].num_lookahead == 4
    last = req.output_ids[-1]
    # The worker gained four tokens, the second an EOS: the request ends on it, the rest is dropped.
    result = StepResult(plan.step_id, [req.req_id] * 4, [5, 2, 6, 7], drafts=[DraftOutcome(req.req_id, 4, 3)])
    [out] = sched.update(result)
    assert out.new_token_ids == [5, 2] and req.output_ids == [last, 5, 2]
    assert out.finish_reason is not None and not sched.running and sched.pool.num_free_blocks == 64


def test_nobody_speculates_in_a_large_batch():
    sched = make_scheduler(num_blocks=64, num_speculative_tokens=2, speculative_disable_batch_size=2)
    for req in make_requests(3, prompt_len=4, max_tokens=8):
        sched.add_request(req)
    worker = FakeWorker()
    sched.update(worker.execute(sched.schedule()))
    plan = sched.schedule()
    assert [row.num_lookahead for row in plan.scheduled] == [0, 0, 0] and not sched.speculating


def test_misses_space_out_the_tries_and_an_accepted_proposal_restores_them():
    spec = Speculation(num_tokens=4, disable_batch_size=8)
    assert spec.lookahead(1, room=10, num_running=1) == 4
    tries = []
    for step in range(40):
        k = spec.lookahead(1, room=10, num_running=1)
        if k:
            tries.append(step)
            spec.observe(DraftOutcome(1, k, 0))
        else:
            spec.decoded_without(1)
    # After each miss the wait doubles: tries at steps 0, 5, 14, 31 (waits of 4, 8, 16).
    assert tries == [0, 5, 14, 31]
    waited = 0
    while not (k := spec.lookahead(1, room=10, num_running=1)):
        spec.decoded_without(1)
        waited += 1
    # A wait of 32 steps (8 of them spent in the loop), then a probe of one token (one more than accepted).
    assert (waited, k) == (24, 1)
    spec.observe(DraftOutcome(1, 1, 1))
    assert spec.lookahead(1, room=10, num_running=1) == 4  # all accepted: the full length again
    spec.observe(DraftOutcome(1, 4, 2))
    assert spec.lookahead(1, room=10, num_running=1) == 3  # one more than was accepted
    assert spec.lookahead(1, room=2, num_running=1) == 2
    assert spec.lookahead(1, room=10, num_running=9) == 0
    assert spec.counters.accepted_per_position == [2, 1, 0, 0]
