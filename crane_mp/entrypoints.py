"""Process entry points for crane-launch's spawned children.

Each imports its process module inside the child: the launcher only pickles a reference to these
functions, so it never pays for the frontend's or worker's imports (seconds of start-up) itself.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

from crane_mp.heap import cap_native_caches, libc

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def name_process(name: str) -> None:
    """What ps, top and psutil show for this child (its comm, 15 bytes at most): spawned children are
    otherwise all `python`, and an operator watching memory cannot tell the worker from a frontend."""
    prctl = getattr(libc(), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def die_with_launcher() -> None:
    """SIGKILL this child when crane-launch dies, however it dies: killed with SIGKILL itself, nothing
    supervises the children any more, and a frontend left behind would hold the port (and answer)
    while its replica is meant to be gone."""
    prctl = getattr(libc(), "prctl", None)
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    launcher = multiprocessing.parent_process()
    if launcher is not None and os.getppid() != launcher.pid:  # it died before the line above
        os._exit(1)


def worker_main(*args) -> None:
    die_with_launcher()
    name_process("crane-worker")
    cap_native_caches()
    from crane_mp.worker.process import run_worker

    run_worker(*args)


def scheduler_main(*args) -> None:
    die_with_launcher()
    name_process("crane-scheduler")
    from crane_mp.scheduler.process import run_scheduler

    run_scheduler(*args)


def frontend_main(config, addresses, frontend_id: int, life: int, metrics_dir: str, conn) -> None:
    die_with_launcher()
    name_process(f"crane-frontend{frontend_id}")
    # Before prometheus_client is imported: every frontend's metrics go to files that a scrape of
    # any one of them sums (frontend/web/metrics.py).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from crane_mp.frontend.process import run_frontend

    run_frontend(config, addresses, frontend_id, life, conn)

