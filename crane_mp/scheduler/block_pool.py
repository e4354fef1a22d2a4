"""KV blocks: who holds each one, and the prefix cache over them. The only writer of block ids.

A full block of a sequence is identified by a hash chained over every token before it (vLLM's
scheme): block i's key is (key of block i-1, its own token ids), so equal keys mean equal prefixes.
Blocks are reference-counted; a block nobody holds stays in the cache, findable by its key, until
its memory is needed. Eviction order is least recently freed first, and a request's later blocks
go before its earlier ones (they are the least likely to be shared).

Which free block an allocation takes: a recently freed one that caches nothing first (its memory is
warm). Then, without `warm_first` (GPU: memory is ready), a never-used block before evicting anything
cached. With it (CPU: the KV cache is memory the kernel maps on first touch, at several microseconds
a page on a VM), the least recently used cached block before a never-used one once _CACHE_RESERVE
blocks (at most a quarter of the pool) are cached and free, so the touched memory grows only with
what requests hold at once plus that reserve; below it, a never-used block, so that the prefix cache
keeps more than the last request's blocks (four interleaved prompt prefixes each evicted the one
before).
"""

from __future__ import annotations

from collections import OrderedDict

BlockKey = int
# Cached blocks kept before touched memory is recycled (warm_first): 65k tokens, dozens of long
# prompt prefixes, and a bounded one-time cost of first touches (256 MiB of the demo's KV cache).
_CACHE_RESERVE = 4096


def chain_keys(
    token_ids: list[int], block_size: int, num_blocks: int, parent: BlockKey, start: int = 0
) -> list[BlockKey]:
    """Keys of full blocks [start, num_blocks) of `token_ids`, chained from `parent` (the key of block
    start - 1, or the root key of the request's namespace)."""
    keys = []
    for i in range(start, num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, warm_first: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.warm_first = warm_first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}  # block id -> key, for cached blocks
        self._cached: dict[BlockKey, int] = {}  # key -> block id
        self._free: list[int] = []  # freed, unreferenced, uncached: the last freed is handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached: LRU first
        self._next_unused = 0  # blocks [_next_unused, num_blocks) were never handed out
        self._cache_reserve = min(num_blocks // 4, _CACHE_RESERVE) if warm_first else 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, cached ones included (they are evicted on demand)."""
        return len(self._free) + len(self._evictable) + self.num_blocks - self._next_unused

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        ids = []
        for _ in range(n):
            unused = self._next_unused < self.num_blocks
            if self._free:
                block = self._free.pop()
            elif unused and not (self.warm_first and len(self._evictable) >= self._cache_reserve):
                block = self._next_unused
                self._next_unused += 1
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._key_of.pop(block)]
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; a request's blocks are given in sequence order."""
        for block in reversed(ids):
            if self._refs[block] <= 0:
                raise KeyError(f"KV block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ---- prefix cache ---------------------------------------------------------------------------

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`, not yet referenced by the caller."""
        hits = []
        if self.enable_caching:
            for key in keys:
                block = self._cached.get(key)
                if block is None:
                    break
                hits.append(block)
        return hits

    def cached_block(self, key: BlockKey) -> int | None:
        """The cached block of `key`, if any (not yet referenced by the caller)."""
        return self._cached.get(key) if self.enable_caching else None

    def num_evictable(self, ids: list[int]) -> int:
        """How many of `ids` nobody holds: taking them uses up free blocks."""
        return sum(self._refs[b] == 0 for b in ids)

    def take(self, ids: list[int]) -> None:
        """Add a reference to each of `ids` (cache hits from lookup)."""
        for block in ids:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def cache(self, block: int, key: BlockKey) -> None:
        """Make a held, fully computed block findable by `key`. A key already cached (two requests
        computed the same prefix at once) keeps its block; this one stays private."""
        if self.enable_caching and key not in self._cached and block not in self._key_of:
            self._cached[key] = block
            self._key_of[block] = key

    def uncache(self, ids: list[int]) -> None:
        """Make `ids` unfindable (their contents can no longer be trusted); holders keep them."""
        for block in ids:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._cached[key]
                if block in self._evictable:
                    del self._evictable[block]
                    self._free.append(block)

    def uncache_keys(self, keys: list[BlockKey]) -> None:
        """Make the blocks cached under `keys` unfindable (uncache, by key)."""
        self.uncache([self._cached[key] for key in keys if key in self._cached])

    def flush(self) -> int:
        """Forget every cached key; returns how many blocks were dropped. Held blocks stay held."""
        dropped = len(self._cached)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._key_of.clear()
        return dropped

    def check_invariants(self, held: dict[int, int]) -> None:
        """`held`: block id -> how many requests hold it, as the scheduler counts."""
        for block in range(self.num_blocks):
            holders = held.get(block, 0)
            assert self._refs[block] == holders, f"block {block}: {self._refs[block]} refs, {holders} holders"
        free, evictable = set(self._free), set(self._evictable)
        unused = set(range(self._next_unused, self.num_blocks))
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & evictable and not (free | evictable) & unused, "a block is free twice over"
        assert all(self._refs[b] == 0 for b in free | evictable | unused), "a held block is free"
        assert evictable <= set(self._key_of), "an evictable block has no key"
        assert not (free | unused) & set(self._key_of), "a free block still has a key"
        held_count = sum(r > 0 for r in self._refs)
        assert len(free | evictable | unused) + held_count == self.num_blocks, "blocks leaked"
        assert {self._cached[k]: k for k in self._cached} == self._key_of, "key maps disagree"
