"""benchmarks/gpu.py drives the runner the way the worker does; a tiny CPU run keeps it from rotting
between GPU sessions (its numbers here mean nothing)."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_the_gpu_benchmark_reports_every_batch_on_cpu(capsys):
    bench = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "gpu.py"))
    bench["main"](["--shape", "small", "--device", "cpu", "--dtype", "float32", "--batches", "1", "3",
                   "--context", "40", "--steps", "3", "--bandwidth-bytes", str(1 << 24)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 | 40 |", "| 3 | 40 |"))]
    assert len(rows) == 2 and all(line.endswith("% |") for line in rows), out


def test_the_last_warm_up_position_has_a_block_when_context_and_steps_fill_whole_blocks(capsys):
    bench = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "gpu.py"))
    bench["main"](["--shape", "small", "--device", "cpu", "--dtype", "float32", "--batches", "2",
                   "--context", "45", "--steps", "3", "--bandwidth-bytes", str(1 << 24)])  # 45 + 3 = 3 blocks
    assert any(line.startswith("| 2 | 45 |") for line in capsys.readouterr().out.splitlines())
