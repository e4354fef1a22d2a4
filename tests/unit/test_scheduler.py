"""Scheduler policy driven without a model: chunked prefill, preemption and resume, caps, aborts."""

from __future__ import annotations

import msgspec
import pytest

from crane_mp.scheduler.block_pool import BlockPool, chain_keys
from crane_mp.scheduler.request import FinishReason, RequestStatus
from crane_mp.protocol import ErrorKind, MediaInput
from crane_mp.scheduler.scheduler import QueueFull, RequestRejected
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


def test_pool_allocates_frees_and_keeps_invariants():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free_blocks == 0
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(a)
    pool.check_invariants({block: 1 for block in b})
    assert pool.num_free_blocks == 3
    with pytest.raises(KeyError):
        pool.free(a)  # double free is a bug, not a no-op


def test_pool_keeps_freed_cached_blocks_until_memory_is_needed_evicting_least_recent_first():
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    keys = chain_keys(list(range(8)), 4, 2, parent=0)
    for block, key in zip(first, keys):
        pool.cache(block, key)
    pool.free(first)
    pool.free(second)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.lookup(keys) == first
    assert pool.lookup([keys[1]]) == [first[1]] and pool.lookup(chain_keys(list(range(1, 9)), 4, 2, 0)) == []
    pool.take(first[:1])  # a hit on the first block only: it is held again, no longer evictable
    assert pool.num_free_blocks == 3
    assert sorted(pool.allocate(2)) == second  # uncached blocks go first
    assert pool.allocate(1) == [first[1]]  # then the cached one nobody holds, evicted
    assert pool.lookup(keys) == first[:1] and pool.num_cached_blocks == 1
    pool.check_invariants({first[0]: 1, first[1]: 1, second[0]: 1, second[1]: 1})


@pytest.mark.parametrize("warm_first", [False, True])
def test_pool_reuses_warm_memory_first_where_asked(warm_first):
    pool = BlockPool(8, warm_first=warm_first)
    held = pool.allocate(5)
    assert held == [0, 1, 2, 3, 4]  # never-used blocks in order
    pool.cache(held[0], 11)
    pool.cache(held[2], 12)
    pool.free(held[:3])  # blocks 0 and 2 cached (evictable), block 1 plain free
    assert pool.allocate(1) == [1]  # a freed block that caches nothing: always first
    # Then either a never-used block (memory is ready: GPU), or on CPU the least recently freed cached
    # block once a quarter of the pool (2 blocks here) is cached and free: touched memory.
    assert pool.allocate(1) == ([2] if warm_first else [5])
    assert pool.lookup([12]) == ([] if warm_first else [2])
    assert pool.allocate(1) == ([5] if warm_first else [6])  # CPU: one cached block left, under the reserve
    assert pool.lookup([11]) == [0]


def test_pool_flush_forgets_every_key_but_not_held_blocks():
    pool = BlockPool(4)
    held = pool.allocate(2)
    keys = chain_keys([5] * 8, 4, 2, parent=0)
    pool.cache(held[0], keys[0])
    pool.cache(held[1], keys[1])
    pool.free(held[1:])
    assert pool.flush() == 2
    assert pool.lookup(keys) == [] and pool.num_free_blocks == 3
    pool.check_invariants({held[0]: 1})


def test_chain_keys_depend_on_every_earlier_token():
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, parent=0)
    b = chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 2, parent=0)
    assert a[0] != b[0] and a[1] != b[1]  # equal second blocks, different prefixes
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, parent=a[0], start=1) == a[1:]
    assert chain_keys([1, 2, 3, 4], 4, 1, parent=1) != a[:1]  # another namespace (adapter, model)


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
    # 30 prompt tokens, more than an idle server's quarter budget (which would only cut them once more):
    # budget-sized chunks from the first step.
    assert chunks[:4] == [8, 8, 8, 6]
    assert all(n <= 8 for p in worker.plans for n in [sum(s.num_new_tokens for s in p.scheduled)])
    assert outputs == reference_outputs([req])


def test_an_idle_server_admits_a_small_first_chunk_then_full_budgets_beside_decodes():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64, max_num_seqs=16)
    reqs = make_requests(12, prompt_len=8, max_tokens=4)
    for req in reqs:
        sched.add_request(req)
    worker = FakeWorker()
    run_to_completion(sched, worker)
    sizes = [len(plan.new_requests) for plan in worker.plans]
    assert sizes[:2] == [2, 8]  # 16 tokens while nobody streams; then 62 beside two decodes (the 8th in part)
    run_to_completion(sched, worker)


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


def test_paced_prompts_take_what_fits_a_step_beside_running_decodes_and_the_pace_follows_the_worker():
    """A slow model (CPU): prompt tokens per step are capped to the target step time at the current
    pace, decodes are never capped, and the pace follows the step times the worker reports."""
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64, max_num_seqs=8,
                           prefill_step_seconds=3.0, prefill_seconds_per_token=0.25)  # 12 prompt tokens a step
    reqs = make_requests(3, prompt_len=10, max_tokens=6)
    for req in reqs:
        sched.add_request(req)
    worker = FakeWorker()
    plans, first_token_step = [], {}
    while sched.has_work:
        plan = sched.schedule()
        plans.append(plan)
        result = worker.execute(plan)
        prompt_tokens = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        result.seconds = 0.25 * prompt_tokens + 0.05 * len(plan.scheduled)
        for out in sched.update(result):
            first_token_step.setdefault(out.rid, len(plans))
    for plan in plans:
        assert sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1) <= 12
    # The first request streams after its own prompt, not after all three (30 tokens: 3 steps at least).
    assert first_token_step[reqs[0].req_id] == 1 and first_token_step[reqs[2].req_id] >= 3
    assert sched.num_free_blocks == sched.config.num_blocks
    assert 0.25 < sched.pace.seconds_per_token < 0.3  # 0.25 s a prompt token, plus the rows' cost


def test_a_fast_model_s_burst_goes_256_prompt_tokens_a_step_and_its_short_tail_at_once():
    """Where the pace allows more (a small model), a step beside others takes at most 256 prompt tokens:
    a burst's first prompts stream before the last ones are computed (unpaced: 512, then 1536 at once).
    The last 512 go in one step: prompts left behind would trail every later arrival."""
    sched = make_scheduler(max_num_batched_tokens=2048, max_model_len=256, max_num_seqs=12, num_blocks=1024,
                           prefill_step_seconds=3.0, prefill_seconds_per_token=0.0001)
    reqs = make_requests(12, prompt_len=128, max_tokens=3)
    for req in reqs:
        sched.add_request(req)
    worker = FakeWorker()
    plans, first_token_step = [], {}
    while sched.has_work:
        plans.append(sched.schedule())
        for out in sched.update(worker.execute(plans[-1])):
            first_token_step.setdefault(out.rid, len(plans))
    prompt_tokens = [sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1) for plan in plans[:5]]
    assert prompt_tokens == [256, 256, 256, 256, 512]
    assert [first_token_step[req.req_id] for req in reqs] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5, 5]
    assert sched.num_free_blocks == sched.config.num_blocks
    assert make_scheduler(max_num_batched_tokens=64).pace.token_cap(16, 100) is None


def test_the_short_queue_rule_stays_within_the_pace():
    pace = make_scheduler(prefill_step_seconds=3.0, prefill_seconds_per_token=0.0001).pace
    assert [pace.token_cap(16, pending) for pending in (100, 300, 512, 513)] == [256, 300, 512, 256]
    pace.seconds_per_token = 0.01  # an 8B-class model: 300 tokens a step at most
    assert [pace.token_cap(16, pending) for pending in (100, 512, 2000)] == [256, 300, 256]


def test_a_prompt_alone_is_not_paced():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64, prefill_step_seconds=3.0,
                           prefill_seconds_per_token=0.25)
    [req] = make_requests(1, prompt_len=40, max_tokens=2)
    sched.add_request(req)
    # The whole prompt: neither paced nor cut to the idle server's quarter budget (16), which it exceeds.
    assert [s.num_new_tokens for s in sched.schedule().scheduled] == [40]


def test_an_idle_server_takes_a_quarter_first_step_only_where_the_first_prompt_fits_in_it():
    # 64-token steps: an idle server's quarter is 16 tokens.
    short_first = make_scheduler(max_model_len=128)
    for req in make_requests(2, prompt_len=[8, 40], max_tokens=2):
        short_first.add_request(req)
    assert [s.num_new_tokens for s in short_first.schedule().scheduled] == [8, 8]  # the 8 stream after it
    long_first = make_scheduler(max_model_len=128)
    for req in make_requests(2, prompt_len=[40, 8], max_tokens=2):
        long_first.add_request(req)
    # Nothing would stream after a quarter step: one full step, after which both do.
    assert [s.num_new_tokens for s in long_first.schedule().scheduled] == [40, 8]
    # What the cache holds is not computed: 4 of a repeated 40 tokens fit in the quarter.
    cached = make_scheduler(max_model_len=128)
    cached.add_request(make_requests(1, prompt_len=40, max_tokens=1)[0])
    run_to_completion(cached, FakeWorker())
    for req in [make_requests(1, prompt_len=40, max_tokens=2)[0], make_requests(2, prompt_len=[1, 40])[1]]:
        cached.add_request(req)
    assert [s.num_new_tokens for s in cached.schedule().scheduled] == [4, 12]


def test_unpaced_scheduler_admits_every_prompt_of_a_burst_in_one_step():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    for req in make_requests(3, prompt_len=5, max_tokens=2):
        sched.add_request(req)
    assert len(sched.schedule().new_requests) == 3
    assert sched.pace.token_cap(4, 15) is None


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

    [cut] = make_requests(1, prompt_len=4, max_tokens=30)  # its grammar closed early to fit max_tokens
    sched.add_request(cut)
    outputs = run_to_completion(sched, FakeWorker(eos_after={cut.req_id: 7}, cut_short=frozenset({cut.req_id})))
    assert outputs[cut.req_id][-1] == 2 and cut.finish_reason == FinishReason.LENGTH

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


def test_overlap_gives_the_same_tokens_and_drops_the_row_after_an_unforeseen_finish():
    results = {}
    for overlap in (False, True):
        sched = make_scheduler(num_blocks=20, max_model_len=64)
        reqs = make_requests(5, prompt_len=[3, 9, 17, 1, 6], max_tokens=30)
        for i, req in enumerate(reqs):
            req.req_id = i  # same ids in both runs so the fake worker's EOS rule matches
            sched.add_request(req)
        worker = FakeWorker(eos_after={1: 20})
        results[overlap] = (run_to_completion(sched, worker, overlap=overlap), worker, sched)
    plain, plain_worker, _ = results[False]
    overlapped, worker, sched = results[True]
    assert overlapped == plain
    assert len(plain[1]) < 30 and plain[1][-1] == 2  # EOS ended request 1
    assert sched.num_preemptions > 0  # 20 blocks of 4 tokens: the resume path ran under overlap too
    # Request 1's EOS was not known when the next step was planned: one extra row, dropped.
    assert worker.num_computed > plain_worker.num_computed
    assert sched.num_free_blocks == sched.config.num_blocks


def test_overlap_never_samples_past_max_tokens():
    sched = make_scheduler()
    reqs = make_requests(3, prompt_len=[2, 5, 9], max_tokens=4)
    for req in reqs:
        sched.add_request(req)
    worker = FakeWorker()
    outputs = run_to_completion(sched, worker, overlap=True)
    assert all(len(outputs[r.req_id]) == 4 for r in reqs)
    assert all(len(worker.tokens.get(r.req_id, [])) == 0 for r in reqs)  # every mirror dropped
    assert sum(len(p.scheduled) for p in worker.plans) == sum(1 + 3 for _ in reqs)  # prefill + 3 decodes each


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefix_hits_the_cache_and_gives_the_same_tokens(overlap):
    prefix = [7 + i % 40 for i in range(21)]  # 5 full blocks of 4, and one more token
    reqs = make_requests(4, prompt_len=3, max_tokens=6)
    for i, req in enumerate(reqs):
        req.prompt_ids = prefix + [50 + i, 60 + i, 70 + i]
    sched = make_scheduler()
    worker = FakeWorker()
    sched.add_request(reqs[0])
    outputs = run_to_completion(sched, worker, overlap=overlap)
    assert reqs[0].num_cached_tokens == 0
    for req in reqs[1:]:
        sched.add_request(req)
    outputs.update(run_to_completion(sched, worker, overlap=overlap))
    assert [r.num_cached_tokens for r in reqs[1:]] == [20, 20, 20]
    assert sched.prefix_cache_queries == 4 * 24 and sched.prefix_cache_hits == 60
    uncached = make_scheduler(enable_prefix_caching=False)
    for req in make_requests(4, prompt_len=3, max_tokens=6):
        req.req_id, req.prompt_ids = reqs[len(uncached.requests)].req_id, list(reqs[len(uncached.requests)].prompt_ids)
        uncached.add_request(req)
    reference_worker = FakeWorker()
    assert run_to_completion(uncached, reference_worker) == outputs
    assert worker.num_computed < reference_worker.num_computed
    assert uncached.prefix_cache_hits == 0


def repeat_after_first(prompt_len: int, **second_sampling):
    """Run one request to completion, then submit a second with the same prompt; returns the
    scheduler, the fake worker, the second request and the plan of its first step."""
    sched = make_scheduler()
    [first] = make_requests(1, prompt_len=prompt_len, max_tokens=3)
    [again] = make_requests(1, prompt_len=prompt_len, max_tokens=3, **second_sampling)
    again.prompt_ids = list(first.prompt_ids)
    sched.add_request(first)
    worker = FakeWorker()
    run_to_completion(sched, worker)
    sched.add_request(again)
    return sched, worker, again, sched.schedule()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, worker, again, plan = repeat_after_first(8)
    [scheduled] = plan.scheduled
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens) == (4, 4)  # the last token's block again
    assert scheduled.reset_blocks and len(scheduled.new_block_ids) == 2
    sched.update(worker.execute(plan))
    run_to_completion(sched, worker)
    assert again.num_cached_tokens == 4


def test_prompt_logprobs_requests_compute_every_position():
    _, _, scored, plan = repeat_after_first(12, prompt_logprobs=0)
    assert plan.scheduled[0].num_computed_tokens == 0 and scored.num_cached_tokens == 0


@pytest.mark.parametrize("warm_first", [False, True])
def test_preempted_request_resumes_from_its_own_cached_blocks(warm_first):
    reqs = make_requests(4, prompt_len=6, max_tokens=20)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_model_len=40, warm_blocks_first=warm_first)
    for r in reqs:
        sched.add_request(r)
    worker = FakeWorker()
    outputs = run_to_completion(sched, worker)
    resumed = [s for p in worker.plans for s in p.scheduled if s.reset_blocks and s.num_computed_tokens > 0]
    assert sched.num_preemptions > 0 and resumed  # some resume started past its first block
    assert outputs == reference_outputs(reqs)


def test_flush_cache_is_refused_while_requests_run():
    sched = make_scheduler()
    reqs = make_requests(2, prompt_len=9, max_tokens=3)
    sched.add_request(reqs[0])
    worker = FakeWorker()
    sched.update(worker.execute(sched.schedule()))
    assert not sched.flush_cache()
    run_to_completion(sched, worker)
    assert sched.pool.num_cached_blocks > 0
    assert sched.flush_cache() and sched.pool.num_cached_blocks == 0
    reqs[1].prompt_ids = list(reqs[0].prompt_ids)
    sched.add_request(reqs[1])
    run_to_completion(sched, worker)
    assert reqs[1].num_cached_tokens == 0


def test_is_streaming_only_once_a_running_request_has_output():
    sched = make_scheduler()
    [req] = make_requests(1, prompt_len=6, max_tokens=3)
    sched.add_request(req)
    worker = FakeWorker()
    plan = sched.schedule()
    assert not sched.is_streaming  # planned, nothing sampled yet: the server does not plan ahead
    sched.update(worker.execute(plan))
    assert sched.is_streaming
    run_to_completion(sched, worker)
    assert not sched.is_streaming


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_fails_in_the_worker_ends_alone_and_its_blocks_come_back_uncached(overlap):
    sched = make_scheduler(num_blocks=40)
    reqs = make_requests(4, prompt_len=[6, 9, 5, 7], max_tokens=12)
    for i, req in enumerate(reqs):
        req.req_id = i
        sched.add_request(req)
    finished: dict = {}
    outputs = run_to_completion(sched, FakeWorker(fail_at={2: 8}), overlap=overlap, finished=finished)
    expected = reference_outputs([r for r in reqs if r.req_id != 2])
    assert {rid: out for rid, out in outputs.items() if rid != 2} == expected
    assert finished[2].finish_reason == FinishReason.ERROR and finished[2].error == "boom"
    assert finished[2].error_kind == ErrorKind.INTERNAL and len(outputs.get(2, [])) == 3  # 5 + 3 = 8
    assert sched.num_free_blocks == sched.config.num_blocks
    # Request 2's blocks left the prefix cache: a new request with its prompt misses.
    again = make_requests(1, prompt_len=5, max_tokens=1)[0]
    again.prompt_ids = list(reqs[2].prompt_ids) + outputs.get(2, [])
    sched.add_request(again)
    sched.schedule()
    assert again.num_cached_tokens == 0  # nothing request 2 computed itself stays findable


def test_the_queue_bound_counts_only_requests_that_must_wait_for_a_slot():
    sched = make_scheduler(max_num_seqs=2, max_queue=3)
    reqs = make_requests(6, prompt_len=4, max_tokens=4)
    for req in reqs[:5]:  # 2 take the free slots, 3 wait
        sched.add_request(req)
    with pytest.raises(QueueFull, match="--max-queue") as err:
        sched.add_request(reqs[5])
    assert err.value.kind == ErrorKind.OVERLOADED and reqs[5].req_id not in sched.requests
    sched.schedule()  # two start running; still 3 waiting
    with pytest.raises(QueueFull):
        sched.add_request(reqs[5])
    sched.abort_request(reqs[4].req_id)
    sched.add_request(reqs[5])
    assert len(sched.waiting) == 3


def test_a_bad_frame_on_the_inbox_is_dropped_not_a_crash(tmp_path, caplog):
    from crane_mp.ipc import Addresses, encode
    from crane_mp.protocol import GenerateRequest, SamplingParams
    from crane_mp.scheduler.process import SchedulerLoop

    loop = SchedulerLoop(make_scheduler(), Addresses(str(tmp_path)), num_frontends=2)
    try:
        loop.receive(b"\x93not a message")
        for frontend_id in (2, -1, 2**40):
            loop.receive(encode(GenerateRequest(7, [1, 2, 3], SamplingParams(), frontend_id=frontend_id)))
        assert not loop.scheduler.has_work and not loop.admitted
        assert sum("dropped" in r.getMessage() for r in caplog.records) == 4
        loop.receive(encode(GenerateRequest(8, [1, 2, 3], SamplingParams(), frontend_id=1)))
        assert loop.scheduler.has_work and list(loop.admitted) == [1]
    finally:
        loop.close()


def test_a_constrained_request_waits_for_its_matcher_before_it_is_scheduled(tmp_path):
    import zmq

    from crane_mp.ipc import Addresses, encode, frontend_decoder, make_socket, worker_decoder
    from crane_mp.protocol import (AbortRequest, FinishReason, GenerateRequest, GrammarReady, PrepareGrammar,
                                   SamplingParams)
    from crane_mp.scheduler.process import SchedulerLoop

    addresses = Addresses(str(tmp_path))
    loop = SchedulerLoop(make_scheduler(), addresses, num_frontends=1)
    worker = make_socket(loop.ctx, zmq.PULL, addresses.worker_inbox, bind=False)
    frontend = make_socket(loop.ctx, zmq.PULL, addresses.frontend_inbox(0), bind=False)
    try:
        constrained = SamplingParams(grammar="start: \"a\"")
        for rid in (1, 2, 3):
            loop.receive(encode(GenerateRequest(rid, [1, 2, 3], constrained)))
        assert [worker_decoder.decode(worker.recv()) for _ in range(3)] == [
            PrepareGrammar(rid, constrained.grammar) for rid in (1, 2, 3)]
        assert not loop.scheduler.has_work and not loop.admitted  # nothing scheduled, no 200 yet

        loop.receive(encode(GrammarReady(1)))
        loop.receive(encode(GrammarReady(2, "ValueError: the output constraint could not be compiled")))
        loop.receive(encode(AbortRequest(3)))
        loop.receive(encode(GrammarReady(3)))  # late: the request is gone
        assert loop.scheduler.has_work and list(loop.admitted) == [0] and not loop.awaiting_grammar
        assert [out.rid for out in loop.admitted[0]] == [1]
        ended = {}
        for _ in range(2):
            [out] = frontend_decoder.decode(frontend.recv()).outputs
            ended[out.rid] = out
        assert ended[2].finish_reason == FinishReason.ERROR and "could not be compiled" in ended[2].error
        assert ended[3].finish_reason == FinishReason.ABORT
        # The worker prepared rid 3's matcher and never sees it in a plan: the next plan drops it, and one
        # aborted before its first step is dropped the same way.
        plan = loop.scheduler.schedule()
        assert plan.finished_req_ids == [3] and [new.req_id for new in plan.new_requests] == [1]
        loop.receive(encode(GenerateRequest(4, [1, 2, 3], constrained)))
        loop.receive(encode(GrammarReady(4)))
        loop.receive(encode(AbortRequest(4)))
        assert 4 in loop.scheduler.schedule().finished_req_ids
    finally:
        worker.close()
        frontend.close()
        loop.close()


def test_a_restarted_frontends_old_requests_are_aborted_and_no_one_elses(tmp_path):
    from crane_mp.ipc import Addresses, encode
    from crane_mp.protocol import FrontendRestarted, GenerateRequest, SamplingParams
    from crane_mp.scheduler.process import SchedulerLoop

    import zmq

    from crane_mp.ipc import make_socket

    addresses = Addresses(str(tmp_path))
    loop = SchedulerLoop(make_scheduler(), addresses, num_frontends=2)
    worker = make_socket(loop.ctx, zmq.PULL, addresses.worker_inbox, bind=False)  # takes PrepareGrammar
    try:
        for rid, frontend_id in ((1, 0), (2, 1), (3, 1)):
            loop.receive(encode(GenerateRequest(rid, [1, 2, 3], SamplingParams(), frontend_id=frontend_id)))
        loop.receive(encode(GenerateRequest(4, [1, 2, 3], SamplingParams(grammar='start: "a"'), frontend_id=1)))
        loop.receive(encode(FrontendRestarted(1)))
        assert set(loop.scheduler.requests) == {1} and not loop.awaiting_grammar
    finally:
        worker.close()
        loop.close()


def test_an_encoder_s_prompts_are_scheduled_whole_and_never_from_the_cache():
    """whole_prompts: no chunk of a prompt, however the budget falls (a prompt longer than what is left
    waits for the next step; one longer than the whole budget goes alone), and no prefix-cache hits."""
    sched = make_scheduler(whole_prompts=True, max_num_batched_tokens=24, enable_prefix_caching=False)
    requests = make_requests(4, prompt_len=[10, 10, 30, 10], max_tokens=1, pooling="last")
    requests[3].prompt_ids = list(requests[0].prompt_ids)  # a repeated prompt: still computed whole
    for req in requests:
        sched.add_request(req)
    worker = FakeWorker()
    run_to_completion(sched, worker)
    steps = [[(s.num_computed_tokens, s.num_new_tokens) for s in plan.scheduled] for plan in worker.plans]
    assert steps[:3] == [[(0, 10), (0, 10)], [(0, 30)], [(0, 10)]]
    assert sched.prefix_cache_hits == 0


def _image(key: str, offset: int, count: int) -> MediaInput:
    return MediaInput("image", key, [count * 4, 8], b"", offset, count, [1, 2 * count, 2])


def test_prompts_with_the_same_image_share_blocks_and_different_images_never_do():
    """Placeholder tokens are equal whatever the image: the key of the blocks from an image on is its content."""
    prompt = [7 + i % 40 for i in range(6)] + [99] * 8 + [8 + i for i in range(10)]  # image at 6..14
    sched, worker = make_scheduler(), FakeWorker()
    reqs = make_requests(4, prompt_len=len(prompt), max_tokens=3)
    for req, key in zip(reqs, ["cat", "cat", "dog", None]):
        req.prompt_ids = list(prompt)
        req.media = [_image(key, 6, 8)] if key else []
        sched.add_request(req)
        run_to_completion(sched, worker)
    # 6 blocks of 4 hold the 24-token prompt: the first (tokens 0..3) never touches the image.
    assert [r.num_cached_tokens for r in reqs] == [0, 20, 4, 4]
    assert reqs[0].block_keys[:1] == reqs[2].block_keys[:1] and reqs[0].block_keys[1] != reqs[2].block_keys[1]


def test_the_pixels_go_to_the_worker_once_and_the_scheduler_keeps_only_the_placement():
    sched, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker()
    [req] = make_requests(1, prompt_len=24, max_tokens=2)
    image = msgspec.structs.replace(_image("cat", 6, 8), values=b"\x01" * 128)
    req.media = [image]
    sched.add_request(req)
    run_to_completion(sched, worker)
    sent = [new.media for plan in worker.plans for new in plan.new_requests]
    assert sent == [[image]]  # once, with its pixels, though the prompt took three steps
    assert req.media == [msgspec.structs.replace(image, values=b"")]


def test_an_audio_window_keys_every_block_of_its_request():
    sched, worker = make_scheduler(), FakeWorker()
    reqs = make_requests(3, prompt_len=12, max_tokens=3)
    for req, key in zip(reqs, ["clip-a", "clip-a", "clip-b"]):
        req.prompt_ids = list(reqs[0].prompt_ids)
        req.media = [MediaInput("audio", key, [80, 3000], b"")]
        sched.add_request(req)
        run_to_completion(sched, worker)
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 0]
