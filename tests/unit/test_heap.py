"""The worker's large freed blocks are used again rather than mapped fresh and faulted in (heap.py),
unless the operator set glibc's own variables."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from crane_mp.heap import libc

# In a fresh interpreter: reuse_freed_blocks(), then a 64 MiB block from the C library written, freed,
# allocated and written again; prints the page faults the second one took.
_SECOND_ALLOCATION_FAULTS = """
import ctypes, resource
from crane_mp.heap import libc, reuse_freed_blocks
reuse_freed_blocks()
c = libc()
c.malloc.restype, c.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 64 << 20
block = c.malloc(size)
ctypes.memset(block, 1, size)
c.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = c.malloc(size)
ctypes.memset(block, 2, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "THP_"))} | env
    done = subprocess.run([sys.executable, "-c", _SECOND_ALLOCATION_FAULTS], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(getattr(libc(), "mallopt", None) is None, reason="no glibc mallopt here")
def test_a_large_freed_block_is_used_again_without_faulting_in_unless_the_operator_says_otherwise():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _faults({}) < pages // 16
    # glibc's default (mapping every block over its threshold) restored by the operator: faulted in again.
    assert _faults({"MALLOC_MMAP_MAX_": "65536"}) > pages // 2
