"""Process entry points for crane-launch's spawned children.

Each imports its process module inside the child: the launcher only pickles a reference to these
functions, so it never pays for the frontend's or worker's imports (seconds of start-up) itself.
"""

from __future__ import annotations

import os


def worker_main(*args) -> None:
    from crane_mp.worker.process import run_worker

    run_worker(*args)


def scheduler_main(*args) -> None:
    from crane_mp.scheduler.process import run_scheduler

    run_scheduler(*args)


def frontend_main(config, addresses, frontend_id: int, life: int, metrics_dir: str, conn) -> None:
    # Before prometheus_client is imported: every frontend's metrics go to files that a scrape of
    # any one of them sums (frontend/metrics.py).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from crane_mp.frontend.process import run_frontend

    run_frontend(config, addresses, frontend_id, life, conn)
