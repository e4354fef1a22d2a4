"""Run a check script under Triton's interpreter: it is chosen when kernels are decorated, so each
check runs in a fresh Python with TRITON_INTERPRET=1, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_interpreted(code: str, *args: str) -> str:
    """The script's stdout; fails the test with its stderr's tail if it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
