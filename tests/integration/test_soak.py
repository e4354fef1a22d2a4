"""A minute of mixed traffic against the demo server (benchmarks/soak.py, 8 clients): every request
answered 200, none lost, every KV block back when idle, and the worker's resident memory as issue 33
bounds it for 12 minutes: at every sample (its peak), not only the last, within its idle size plus the
plan's activation reserve plus 256 MiB, and growing under 2 % over the last half of the run (a minute is
short: the whole mix goes through every client once first, so that half measures a warm server). The KV
budget is 16k tokens: on the CPU the block pool touches new KV memory until a quarter of the pool (at most
4,096 blocks, the demo's 256 MiB) is cached and free (block_pool.py), which the default pool's warm-up
would fill only on a fast host; a quarter of this one's fills in the warm-up on any, so what the last half
measures is growth that no bound explains."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from tests.integration.server import Server

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_a_minute_of_mixed_traffic_loses_nothing_and_keeps_the_workers_memory_bounded(tmp_path):
    server = Server(None, "--demo", "--dtype", "auto", "--max-total-tokens", "16384", "--no-access-log",
                    log_path=tmp_path / "server.log")
    try:
        soak = runpy.run_path(str(SOAK))
        report = soak["main"](["--url", server.url, "--server-pid", str(server.proc.pid), "--minutes", "1",
                               "--concurrency", "8", "--sample-seconds", "5", "--warmup-rounds", "1"])
    finally:
        server.kill_all()
    statuses = report["statuses"]
    assert report["requests"] >= len(soak["ORDER"]) and report["lost"] == 0
    assert set(statuses) == set(soak["KINDS"])  # every kind of request was sent (ORDER holds each)
    assert all(set(by_status) == {200} for by_status in statuses.values()), statuses
    assert report["server_errors"] == 0 and not report["transport_errors"] and not report["incomplete"]
    assert report["kv_blocks_in_use_when_idle"] == 0
    worker = report["worker"]
    assert worker["activation_reserve_mib"] > 0
    assert worker["within_bound"], worker
    peak = max(mib for _, mib in report["rss_mib"]["crane-worker"])
    assert peak <= worker["bound_mib"], report["rss_mib"]["crane-worker"]
    assert worker["growth_last_half"] < 0.02, worker
    assert set(report["rss_mib"]) >= {"crane-worker", "crane-scheduler", "crane-frontend0"}
