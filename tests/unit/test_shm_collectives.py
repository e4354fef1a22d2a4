"""The shared-memory collectives of tensor-parallel ranks on one host: sums and gathers equal to the
reference with the same bits on every rank, over many calls of changing shapes (the two slot sets
alternating), and a peer that never answers ends in RankLost, not a hang."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from crane_mp.worker.parallel import shm_collectives
from crane_mp.worker.parallel.shm_collectives import SharedMemoryCollectives
from crane_mp.worker.platforms.device import RankLost


def run_ranks(tmp_path, size: int, work) -> list:
    """`work(rank, collectives)` on `size` threads, one per rank (each rank's process in the server)."""
    path = str(tmp_path / "collectives")
    ranks = [SharedMemoryCollectives(path, 0, size, 1 << 16, create=True)]
    ranks += [SharedMemoryCollectives(path, r, size, 1 << 16, create=False) for r in range(1, size)]
    results: list = [None] * size
    errors: list = []

    def one(rank: int) -> None:
        try:
            results[rank] = work(rank, ranks[rank])
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # a spinning thread hands the GIL on at once, as a process needs not
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_match_on_every_rank_call_after_call(tmp_path, size):
    calls = [(rows, dtype) for rows in (1, 7, 16, 3) for dtype in (torch.float32, torch.bfloat16)] * 3

    def inputs(rank: int, call: int, rows: int, dtype) -> torch.Tensor:
        return torch.randn(rows, 24, generator=torch.Generator().manual_seed(100 * call + rank)).to(dtype)

    def work(rank: int, comm: SharedMemoryCollectives) -> list[torch.Tensor]:
        out = []
        for call, (rows, dtype) in enumerate(calls):
            out.append(comm.all_reduce(inputs(rank, call, rows, dtype)))
            out.append(comm.gather_columns(inputs(rank, call, rows, dtype)))
        return out

    results = run_ranks(tmp_path, size, work)
    for call, (rows, dtype) in enumerate(calls):
        parts = [inputs(r, call, rows, dtype) for r in range(size)]
        want_sum = parts[0] + parts[1]
        for part in parts[2:]:
            want_sum = want_sum + part
        for rank_results in results:  # the same bits everywhere: each rank adds in rank order
            assert torch.equal(rank_results[2 * call], want_sum)
            assert torch.equal(rank_results[2 * call + 1], torch.cat(parts, dim=1))


def test_only_tensors_that_fit_a_slot_go_through_it(tmp_path):
    comm = SharedMemoryCollectives(str(tmp_path / "c"), 0, 2, 1024, create=True)
    assert comm.fits(torch.zeros(256)) and not comm.fits(torch.zeros(257))


def test_a_peer_that_never_answers_ends_in_rank_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_collectives, "_DEADLINE_SECONDS", 0.2)
    comm = SharedMemoryCollectives(str(tmp_path / "c"), 0, 2, 1024, create=True)
    with pytest.raises(RankLost, match="stopped answering"):
        comm.all_reduce(torch.ones(4))
