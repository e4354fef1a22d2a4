"""Scheduler policy driven without a model: chunked prefill, preemption and resume, caps, aborts."""

from __future__ import annotations

import pytest

from crane_mp.scheduler.block_allocator import BlockAllocator
from crane_mp.scheduler.request import FinishReason, RequestStatus
from crane_mp.scheduler.scheduler import RequestRejected
from tests.factories import FakeWorker, make_requests, make_scheduler, run_to_completion


def reference_outputs(requests, **scheduler_kwargs) -> dict[int, list[int]]:
    """Each request run alone with plenty of blocks: the ground truth batching must not change."""
    outputs = {}
    for req in requests:
        sched = make_scheduler(num_blocks=256, max_model_len=256, **scheduler_kwargs)
        fresh = make_requests(1, prompt_len=len(req.prompt_ids), max_tokens=req.sampling.max_tokens)[0]
        fresh.req_id, fresh.prompt_ids = req.req_id, list(req.prompt_ids)
        sched.add_request(fresh)
        outputs.update(run_to_completion(sched, FakeWorker()))
    return outputs


def test_allocator_allocates_frees_and_keeps_invariants():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(set(a) | set(b)) == 8 and alloc.num_free_blocks == 0
    assert not alloc.can_allocate(1)
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    alloc.free(a)
    alloc.check_invariants()
    assert alloc.num_free_blocks == 3
    with pytest.raises(KeyError):
        alloc.free(a)  # double free is a bug, not a no-op


def test_batch_runs_to_completion_and_frees_every_block():
    sched = make_scheduler()
    reqs = make_requests(5, prompt_len=[3, 9, 17, 1, 6], max_tokens=7)
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, FakeWorker())
    assert {len(o) for o in outputs.values()} == {7}
    assert sched.num_free_blocks == sched.config.num_blocks
    assert outputs == reference_outputs(reqs)


def test_long_prompt_is_prefilled_in_chunks_within_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    [req] = make_requests(1, prompt_len=30, max_tokens=3)
    sched.add_request(req)
    worker = FakeWorker()
    outputs = run_to_completion(sched, worker)
    chunks = [s.num_new_tokens for p in worker.plans for s in p.scheduled]
    assert chunks[:4] == [8, 8, 8, 6]  # 30 prompt tokens in budget-sized chunks, then decodes
    assert all(n <= 8 for p in worker.plans for n in [sum(s.num_new_tokens for s in p.scheduled)])
    assert outputs == reference_outputs([req])


def test_decodes_keep_running_while_a_long_prompt_prefills():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=128)
    short, long = make_requests(2, prompt_len=[2, 60], max_tokens=12)
    sched.add_request(short)
    worker = FakeWorker()
    sched.update(worker.execute(sched.schedule()))
    sched.add_request(long)
    plan = sched.schedule()
    by_id = {s.req_id: s.num_new_tokens for s in plan.scheduled}
    assert by_id == {short.req_id: 1, long.req_id: 7}  # the decode is served first, the prefill takes the rest


def test_preemption_is_lossless_and_lowers_then_restores_the_cap():
    # 12 blocks of 4 tokens = 48 KV tokens for 4 requests that each want 6 + 20 tokens: preemption must happen.
    reqs = make_requests(4, prompt_len=6, max_tokens=20)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_model_len=40)
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, FakeWorker())
    assert sched.num_preemptions > 0
    assert all(r.num_preemptions >= 0 for r in reqs) and any(r.num_preemptions for r in reqs)
    assert outputs == reference_outputs(reqs)
    assert sched.max_running == sched.config.max_num_seqs
    assert sched.num_free_blocks == 12


def test_preemption_picks_the_longest_output():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=24)
    a, b = make_requests(2, prompt_len=[4, 4], max_tokens=16)
    sched.add_request(a)
    worker = FakeWorker()
    for _ in range(5):  # a runs ahead alone
        sched.update(worker.execute(sched.schedule()))
    sched.add_request(b)
    preempted = []
    for _ in range(30):
        plan = sched.schedule()
        if plan is None:
            break
        preempted += plan.preempted_req_ids
        sched.update(worker.execute(plan))
        sched.check_invariants()
    assert preempted and preempted[0] == a.req_id


def test_abort_in_every_state_frees_blocks_and_tells_the_worker():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    waiting, prefilling, decoding = make_requests(3, prompt_len=[4, 30, 3], max_tokens=10)
    worker = FakeWorker()
    sched.add_request(decoding)
    sched.update(worker.execute(sched.schedule()))
    sched.add_request(prefilling)
    sched.add_request(waiting)  # over the cap of 2 running: stays waiting
    sched.update(worker.execute(sched.schedule()))
    assert waiting.status == RequestStatus.WAITING
    assert prefilling.status == RequestStatus.RUNNING and prefilling.num_computed_tokens < 30
    for req in (waiting, prefilling, decoding):
        sched.abort_request(req.req_id)
        assert req.finish_reason == FinishReason.ABORT
        sched.check_invariants()
    assert sched.abort_request(12345) is None  # unknown ids are ignored
    assert sched.num_free_blocks == sched.config.num_blocks
    plan = sched.schedule()
    assert sorted(plan.finished_req_ids) == sorted([prefilling.req_id, decoding.req_id])
    worker.execute(plan)
    assert worker.tokens == {}
    assert sched.schedule() is None


def test_finish_by_eos_stop_token_and_min_tokens():
    sched = make_scheduler()
    [eos_req] = make_requests(1, prompt_len=4, max_tokens=30)
    sched.add_request(eos_req)
    outputs = run_to_completion(sched, FakeWorker(eos_after={eos_req.req_id: 7}))
    assert outputs[eos_req.req_id][-1] == 2 and eos_req.finish_reason == FinishReason.STOP

    [ignore] = make_requests(1, prompt_len=4, max_tokens=6, ignore_eos=True)
    sched.add_request(ignore)
    outputs = run_to_completion(sched, FakeWorker(eos_after={ignore.req_id: 5}))
    assert len(outputs[ignore.req_id]) == 6 and ignore.finish_reason == FinishReason.LENGTH

    [min_req] = make_requests(1, prompt_len=4, max_tokens=9, min_tokens=3)
    sched.add_request(min_req)
    outputs = run_to_completion(sched, FakeWorker(eos_after={min_req.req_id: 4}))
    assert len(outputs[min_req.req_id]) == 3 and min_req.finish_reason == FinishReason.STOP

    worker = FakeWorker()
    [probe] = make_requests(1, prompt_len=4, max_tokens=5)
    sched.add_request(probe)
    first = run_to_completion(sched, worker)[probe.req_id]
    [stop_req] = make_requests(1, prompt_len=4, max_tokens=5, stop_token_ids=[first[2]])
    stop_req.prompt_ids = list(probe.prompt_ids)
    sched.add_request(stop_req)
    outputs = run_to_completion(sched, FakeWorker())
    assert outputs[stop_req.req_id] == first[:3]
    assert stop_req.finish_reason == FinishReason.STOP and stop_req.stop_token_id == first[2]


def test_rejects_requests_that_can_never_fit():
    sched = make_scheduler(max_model_len=32)
    [too_long] = make_requests(1, prompt_len=30, max_tokens=5)
    with pytest.raises(RequestRejected, match="maximum context length is 32"):
        sched.add_request(too_long)
    [empty] = make_requests(1, prompt_len=0)
    with pytest.raises(RequestRejected):
        sched.add_request(empty)
    assert not sched.has_work


def test_concurrency_cap_is_respected():
    sched = make_scheduler(max_num_seqs=3, num_blocks=128)
    for r in make_requests(7, prompt_len=5, max_tokens=6):
        sched.add_request(r)
    worker = FakeWorker()
    while (plan := sched.schedule()) is not None:
        assert len(sched.running) <= 3
        sched.update(worker.execute(plan))
    assert sched.num_free_blocks == 128


def test_worker_gets_full_data_once_then_diffs():
    sched = make_scheduler(block_size=4)
    [req] = make_requests(1, prompt_len=5, max_tokens=10)
    sched.add_request(req)
    worker = FakeWorker()
    run_to_completion(sched, worker)
    news = [n for p in worker.plans for n in p.new_requests]
    assert [n.req_id for n in news] == [req.req_id]
    decode_blocks = [s.new_block_ids for p in worker.plans[1:] for s in p.scheduled]
    # 15 tokens in 4-token blocks: 2 blocks at prefill, then one new block id exactly every 4 decode steps.
    assert sum(len(b) for b in decode_blocks) == 2
    assert all(len(b) <= 1 for b in decode_blocks)


def test_multi_round_decode_gives_the_same_tokens_with_fewer_plans():
    lengths = [3, 9, 17, 1, 6]
    results = {}
    for rounds in (1, 8):
        sched = make_scheduler(max_model_len=64, decode_tokens_per_seq=rounds)
        reqs = make_requests(5, prompt_len=lengths, max_tokens=30)
        for i, req in enumerate(reqs):
            req.req_id = i  # same ids in both runs so the fake worker's EOS rule matches
            sched.add_request(req)
        worker = FakeWorker(eos_after={1: 20})
        results[rounds] = (run_to_completion(sched, worker), worker.plans, sched)
    single, single_plans, _ = results[1]
    multi, multi_plans, multi_sched = results[8]
    assert multi == single
    assert len(multi[1]) < 30  # EOS inside a multi-round plan still ends the request there
    assert any(p.num_decode_steps > 1 for p in multi_plans)
    assert len(multi_plans) < len(single_plans)
    assert multi_sched.num_free_blocks == multi_sched.config.num_blocks
