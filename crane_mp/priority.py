"""Threads that compile grammars or load adapters run at the lowest CPU priority.

On a host whose cores all run the worker's compute threads, one more runnable thread at the same
priority takes a core from a parallel matmul in the middle of a step, and the step waits for it:
measured on 2 cores, decode steps of 20 ms went to 200 ms (p99) while a 200 KB schema compiled beside
them. At nice 19 that thread runs in the gaps between steps instead (p99 28 ms), and the compile takes
about three times as long while the host is busy.
"""

from __future__ import annotations

import os
import sys
import threading

_LOWEST = 19


def lower_this_thread() -> None:
    """Give the calling thread (only it: Linux sets priority per thread id) the lowest priority."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST)
        except OSError:  # a sandbox that forbids it: the thread runs at normal priority
            pass
