"""Run a check script under Triton's interpreter: it is chosen when kernels are decorated, so each
check runs in a fresh Python with TRITON_INTERPRET=1, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_interpreted(code: str) -> str:
    """The script's stdout; fails the test with its stderr's tail if it exits non-zero."""
    return run_interpreted_together(code)[0]


def run_interpreted_together(*codes: str) -> list[str]:
    """Each script's stdout, the scripts run at once in processes of their own (the interpreter keeps one
    core busy, and a test runs alone); fails the test with a failing script's stderr tail."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=ROOT) for code in codes]
    outputs = []
    try:
        for run in runs:
            out, err = run.communicate(timeout=900)
            assert run.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for run in runs:
            run.kill()
            run.wait()
    return outputs
