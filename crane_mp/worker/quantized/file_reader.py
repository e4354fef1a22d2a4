"""Read byte ranges of a model file into anonymous memory, with several read() calls in flight.

Why not serve the weights from a mapping of the file: clean file pages of an idle process are the
first thing the kernel reclaims (proactive reclaim such as DAMON's pageout evicted a mapped 5 GB
model within minutes on our VMs), and each page then comes back from disk, one fault at a time, in
the middle of a request. Anonymous memory stays (no swap on an inference host), in huge pages
(numpy advises them for large arrays), and is read at the disk's speed: one sequential reader got
0.27 GB/s from a cold virtio disk where four concurrent ones got 1.4 GB/s.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

_CHUNK = 16 << 20
_READERS = 4


def read_ranges(path: Path, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
    """File bytes [offset, offset + length) for each (offset, length), as new uint8 arrays."""
    out = [np.empty(length, dtype=np.uint8) for _, length in ranges]
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def read_chunk(job: tuple[int, int]) -> None:
            index, start = job
            offset, length = ranges[index]
            view = memoryview(out[index])
            end = min(length, start + _CHUNK)
            while start < end:
                count = os.preadv(fd, [view[start:end]], offset + start)
                if count == 0:
                    raise EOFError(f"{path} ends before byte {offset + end}")
                start += count

        jobs = [(i, start) for i, (_, length) in enumerate(ranges) for start in range(0, length, _CHUNK)]
        with ThreadPoolExecutor(_READERS) as pool:  # preadv releases the GIL
            list(pool.map(read_chunk, jobs))
    finally:
        os.close(fd)
    return out
