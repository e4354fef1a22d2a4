"""KV groups of sliding-window layers: each group's block table, released behind its window, shared prefix
blocks, preemption and failures, checked by the fake worker's KV of every group (tests/factories.py)."""

from __future__ import annotations

import pytest

from crane_mp.models.kv_groups import FULL, group_layers, sequence_blocks
from crane_mp.scheduler.request import FinishReason
from tests.factories import FakeWorker, make_requests, make_scheduler, run_to_completion

# A Gemma-3-like model on 4-token blocks: one full group and two groups of 8-token windows.
WINDOWS = (FULL, 8, 8)


def run(reqs, windows=WINDOWS, overlap=False, worker=None, **config):
    sched = make_scheduler(kv_windows=windows, **config)
    for req in reqs:
        sched.add_request(req)
    worker = worker or FakeWorker(windows=windows)
    return sched, worker, run_to_completion(sched, worker, overlap=overlap)


def copies(reqs):
    fresh = make_requests(len(reqs))
    for new, old in zip(fresh, reqs):
        new.req_id, new.prompt_ids, new.sampling = old.req_id, list(old.prompt_ids), old.sampling
    return fresh


def test_layers_group_by_kind_with_equally_many_layers_per_group():
    # Gemma 3: five sliding layers per global one; 10 layers, two of them global.
    windows = [None if i % 5 == 4 else 512 for i in range(10)]
    groups = group_layers(windows, [(4, 64)] * 10)
    assert groups.windows == (FULL, 512, 512, 512, 512) and groups.layers_per_group == 2
    assert groups.layer_slots[4] == (0, 0) and groups.layer_slots[9] == (0, 1)
    assert groups.layer_slots[0] == (1, 0) and groups.layer_slots[8] == (4, 1)
    assert len(set(groups.layer_slots)) == 10  # no two layers share a group's tensor
    assert group_layers([None] * 3, [(4, 64)] * 3).windows == (FULL,)
    assert group_layers([8] * 3, [(4, 64)] * 3).windows == (8,)  # Mistral: one sliding group
    assert groups.scales == (1,) * 5


def test_kinds_of_different_kv_shapes_share_one_page_size():
    # Gemma 4: the global kind's rows twice as wide, or (its large sizes) half as wide, as the sliding ones'.
    windows = [512, 512, None, 512, 512, None]
    wide = group_layers(windows, [(1, 512) if w is None else (1, 256) for w in windows])
    assert wide.windows == (FULL, 512, 512) and wide.scales == (1, 2, 2) and wide.layers_per_group == 2
    narrow = group_layers(windows, [(4, 512) if w is None else (16, 256) for w in windows])
    assert narrow.scales == (2, 1, 1)
    assert group_layers([None, 512], [(4, 64), (2, 128)]).scales == (1, 1)  # equal rows
    # A kind of two shapes, or rows that do not divide the widest: the plain layout, nothing released.
    for shapes in ([(4, 64), (2, 64), (1, 64)], [(3, 64), (2, 64), (2, 64)]):
        plain = group_layers([None, 512, 512], shapes)
        assert plain.windows == (FULL,) and plain.layer_slots == ((0, 0), (0, 1), (0, 2)) and plain.scales == (1,)


@pytest.mark.parametrize("overlap", [False, True])
def test_released_windows_give_the_same_tokens_as_every_layer_global(overlap):
    reqs = make_requests(5, prompt_len=[3, 17, 30, 9, 41], max_tokens=20)
    sched, worker, outputs = run(copies(reqs), overlap=overlap, max_num_batched_tokens=16)
    _, _, expected = run(copies(reqs), windows=(FULL,), max_num_batched_tokens=16)
    assert outputs == expected
    assert sched.num_free_blocks == sched.config.num_blocks


def test_a_long_sequence_holds_only_its_windows_in_sliding_groups():
    [req] = make_requests(1, prompt_len=50, max_tokens=60)
    sched = make_scheduler(kv_windows=WINDOWS, max_num_batched_tokens=8, max_model_len=128, num_blocks=128)
    sched.add_request(req)
    worker = FakeWorker(windows=WINDOWS)
    most = 0
    while (plan := sched.schedule()) is not None:
        held = [[b for b in table if b != sched.no_block] for table in req.group_block_ids]
        most = max([most, *map(len, held)])
        sched.update(worker.execute(plan))
        sched.check_invariants()
    # The 8-token window before a step's first query and the step's 8 tokens: 4 or 5 blocks of 4, of 28.
    assert 3 <= most <= sequence_blocks((8,), 110, 4, 8) == (8 - 1 + 8) // 4 + 2


def test_more_long_streams_run_at_once_than_with_every_layer_global():
    def most_streaming(windows):
        reqs = make_requests(6, prompt_len=40, max_tokens=24)
        sched = make_scheduler(kv_windows=windows, num_blocks=90, max_model_len=64, max_num_batched_tokens=16)
        for req in reqs:
            sched.add_request(req)
        worker, most = FakeWorker(windows=windows), 0
        while (plan := sched.schedule()) is not None:
            most = max(most, sum(s.num_new_tokens == 1 for s in plan.scheduled))
            sched.update(worker.execute(plan))
        return most

    # 90 blocks: 30 per group when all three hold every token, two streams of 41 to 64 tokens at most;
    # with windows released, each stream needs its 16 full blocks and 3 per sliding group.
    assert most_streaming(WINDOWS) >= 3 > most_streaming((FULL, FULL, FULL))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shared_prefix_is_found_with_the_windows_before_it(overlap):
    prefix = [7 + i % 40 for i in range(37)]  # 9 full blocks, and one more token
    first, *others = make_requests(3, prompt_len=3, max_tokens=6)
    for i, req in enumerate([first, *others]):
        req.prompt_ids = prefix + [50 + i, 60 + i]
    sched, worker, outputs = run([first], overlap=overlap)
    for req in others:
        sched.add_request(req)
    outputs.update(run_to_completion(sched, worker, overlap=overlap))
    assert [req.num_cached_tokens for req in others] == [36, 36]
    reference = make_scheduler(kv_windows=WINDOWS, enable_prefix_caching=False)
    for req in copies([first, *others]):
        reference.add_request(req)
    assert run_to_completion(reference, FakeWorker(windows=WINDOWS)) == outputs


def test_a_prefix_whose_window_blocks_were_evicted_is_found_only_as_far_as_a_window_is_held():
    prefix = [7 + i % 40 for i in range(40)]
    first, again = make_requests(2, prompt_len=3, max_tokens=4)
    first.prompt_ids, again.prompt_ids = prefix + [1], prefix + [2]
    sched, worker, _ = run([first])
    # Drop the sliding groups' copies of blocks 6..9 (as memory pressure would): only the full group has them.
    keys = first.block_keys
    for group in (1, 2):
        sched.pool.uncache_keys([hash((key, group)) for key in keys[6:10]])
    sched.add_request(again)
    run_to_completion(sched, worker)
    # The longest prefix whose 8-token window (blocks 4, 5) is still cached in every group: 6 blocks.
    assert again.num_cached_tokens == 24


def test_preempted_streams_resume_losslessly_with_windows():
    reqs = make_requests(4, prompt_len=10, max_tokens=30)
    sched, _, outputs = run(copies(reqs), num_blocks=40, max_num_seqs=4, max_model_len=48)
    assert sched.num_preemptions > 0
    _, _, expected = run(copies(reqs), windows=(FULL,), num_blocks=200, max_model_len=48)
    assert outputs == expected and sched.num_free_blocks == 40


def test_a_failed_request_leaves_no_block_of_any_group_in_the_cache():
    reqs = make_requests(2, prompt_len=[30, 12], max_tokens=12)
    reqs[0].req_id = 0
    finished: dict = {}
    sched = make_scheduler(kv_windows=WINDOWS)
    for req in reqs:
        sched.add_request(req)
    run_to_completion(sched, FakeWorker(windows=WINDOWS, fail_at={0: 35}), finished=finished)
    assert finished[0].finish_reason == FinishReason.ERROR
    assert sched.num_free_blocks == sched.config.num_blocks
    [again] = make_requests(1, prompt_len=3, max_tokens=1)
    again.prompt_ids = list(reqs[0].prompt_ids) + [5, 5]
    sched.add_request(again)
    sched.schedule()
    assert again.num_cached_tokens == 0
    assert not any(sched.pool.cached_block(hash((key, group))) for key in reqs[0].block_keys for group in (1, 2))


def test_the_cache_must_hold_one_full_length_sequence_over_every_group():
    # 32 full blocks, and per sliding group the window before a step and a 64-token step: 19 blocks.
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(kv_windows=WINDOWS, num_blocks=32 + 2 * 19 - 1, max_model_len=128)
    make_scheduler(kv_windows=WINDOWS, num_blocks=32 + 2 * 19, max_model_len=128)
