"""Model file bytes for the loader: read into anonymous memory with several read() calls in flight,
or mapped for tensors that are converted (repacked, dequantized) into memory of their own at once.

Why not serve the weights from a mapping of the file: clean file pages of an idle process are the
first thing the kernel reclaims (proactive reclaim such as DAMON's pageout evicted a mapped 5 GB
model within minutes on our VMs), and each page then comes back from disk, one fault at a time, in
the middle of a request. Anonymous memory stays (no swap on an inference host), in huge pages
(numpy advises them for large arrays), and is read at the disk's speed: one sequential reader got
0.27 GB/s from a cold virtio disk where four concurrent ones got 1.4 GB/s. A tensor that is
converted anyway needs no copy of its own first: the conversion reads it from the mapping (an 8B
Q4_K_M spent 7-9 s copying 5 GB from the page cache into memory it then repacked and freed; its
weights now load in 11-11.5 s from a warm page cache against 12-14 s, 19-23 s cold against 23 s).
What has been copied out can leave the page cache (`release`): nothing reads it again, and the
copies that follow reuse its memory (gguf_loader.py says why that matters).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from crane_mp.heap import libc

_CHUNK = 16 << 20
_READERS = 4
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22
_madvise = getattr(libc(), "madvise", None)


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


class MappedFile:
    """A file mapped copy-on-write (its pages are the page cache's until written), with the given
    ranges asked of the disk ahead, several at a time, so a cold file arrives at the disk's speed
    while the first tensors are converted. Views of the mapping are for converting at once; anything
    kept must be copied out (`holds` tells). The mapping goes when the last view does."""

    def __init__(self, path: Path, ranges: list[tuple[int, int]]) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._bytes = np.frombuffer(mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY), dtype=np.uint8)
        self._start = self._bytes.__array_interface__["data"][0]
        self._pool = ThreadPoolExecutor(_READERS)
        self._ahead = {offset: [self._pool.submit(self._read_ahead, start, min(_CHUNK, offset + length - start))
                                for start in range(offset, offset + length, _CHUNK)]
                       for offset, length in ranges}  # range start -> its chunks' reads

    def _read_ahead(self, offset: int, length: int) -> None:
        # MADV_POPULATE_READ (Linux 5.14) also maps the pages, so the converting threads take fewer
        # page faults (0.5-2 s of an 8B Q4_K_M's load); ctypes lets go of the GIL while it waits for
        # the disk. Older kernels only get the pages read ahead.
        page = mmap.PAGESIZE
        start = offset // page * page
        if _madvise is None or _madvise(ctypes.c_void_p(self._start + start), ctypes.c_size_t(offset + length - start),
                                        _MADV_POPULATE_READ) != 0:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)

    def view(self, offset: int, length: int) -> np.ndarray:
        if offset + length > len(self._bytes):
            raise EOFError(f"{self.path} ends before byte {offset + length}")
        return self._bytes[offset : offset + length]

    def release(self, offset: int, length: int) -> None:
        """Drops bytes [offset, offset + length), copied out already, from the mapping and from the page
        cache (pages another process maps stay). A range given at the start is no longer read ahead: a
        read after the drop would bring it back."""
        for read in self._ahead.pop(offset, ()):
            if not read.cancel():
                read.result()
        page = mmap.PAGESIZE
        start, end = -(-offset // page) * page, (offset + length) // page * page
        if _madvise is not None and end > start:
            _madvise(ctypes.c_void_p(self._start + start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def holds(self, tensor) -> bool:
        """Whether `tensor`'s bytes are the mapping's."""
        address = tensor.untyped_storage().data_ptr()
        return self._start <= address < self._start + len(self._bytes)

    def close(self) -> None:
        """Stops asking ahead; the mapping itself stays while views of it live."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self._fd)
        self._bytes = np.empty(0, dtype=np.uint8)
