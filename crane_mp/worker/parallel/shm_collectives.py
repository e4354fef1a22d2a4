"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one host's CPU.

gloo's collectives over loopback TCP take 0.2-2 ms each; a decode step makes two per layer, which
cost more than the step's own arithmetic on a small model. Here each rank writes its tensor into its
slot of a shared mapping, raises its flag, waits for every other rank's flag, and then reads all the
slots, summing them in rank order, so every rank gets the same bits. Two sets of slots alternate: a
rank may start the next call while a slower one still reads this call's set, never two ahead (vLLM's
CPU backend and SGLang's shm all-reduce work alike).

A peer that dies leaves its flag unraised: waits give up after a deadline with RankLost, and the
launcher (or the heartbeat) stops the rest. Tensors larger than a slot go through gloo instead.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch

from crane_mp.worker.platforms.device import RankLost

# A wait this long means the peer is gone or hung (a step's own work between two collectives is
# far shorter; the first steps after start-up compile nothing on CPU).
_DEADLINE_SECONDS = 300.0
# Spin this many checks before yielding the core: ranks that share cores must let each other run.
_SPINS = 100
_FLAG_BYTES = 64  # one cache line per flag: ranks never write the same line


class SharedMemoryCollectives:
    """Rank `rank` of `size` over the mapping at `path` (created by rank 0 at `slot_bytes` per slot,
    then opened by the others; each keeps its mapping after the file is unlinked)."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        flags_bytes = size * _FLAG_BYTES
        total = flags_bytes + 2 * size * slot_bytes
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # every page now: a full tmpfs fails here, not mid-step
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        # Flags: each rank's count of finished writes, which every rank polls.
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=flags_bytes // 8).reshape(size, _FLAG_BYTES // 8)
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=flags_bytes).view(2, size, slot_bytes)
        self._calls = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish x; once every rank has, each rank's x as a view of its slot."""
        self._calls += 1
        call = self._calls
        slots = self._slots[call % 2]
        nbytes = x.numel() * x.element_size()
        views = [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]
        views[self.rank].copy_(x)
        self._flags[self.rank, 0] = call  # after the copy: x86 keeps stores in order
        self._wait(call)
        return views

    def _wait(self, call: int) -> None:
        flags = self._flags[:, 0]
        spins = 0
        deadline = None
        while flags.min() < call:
            spins += 1
            if spins % _SPINS == 0:
                now = time.monotonic()
                deadline = deadline or now + _DEADLINE_SECONDS
                if now > deadline:
                    raise RankLost(f"tensor-parallel rank {self.rank}: a peer rank stopped answering")
                os.sched_yield()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place; rank order on every rank, so every rank has the same bits."""
        views = self._exchange(x)
        torch.add(views[0], views[1], out=x)
        for view in views[2:]:
            x.add_(view)
        return x

    def from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank (a copy)."""
        return self._exchange(x)[0].clone()

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [rows, columns] side by side."""
        return torch.cat(self._exchange(x.contiguous()), dim=1)
