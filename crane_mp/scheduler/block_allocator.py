"""KV block allocator: which block ids are free. The only writer of block ids in the system."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for block_id in ids:
            self._used.remove(block_id)
        # Freed blocks go to the back so recently used memory is reused last (cache-friendlier for prefixes later).
        self._free.extend(ids)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & self._used, "a block is both free and used"
        assert len(free) + len(self._used) == self.num_blocks, "blocks leaked"
