"""Two (or more) virtual environments with the same crane-mp sources start the demo server by turns:
the first start in each builds the native kernels; no later start may build or rebuild any (the build
directory is keyed by the environment's include and library paths, kernels/loader.py).

    python benchmarks/alternating_envs.py /path/to/venv-a /path/to/venv-b /path/to/venv-a /path/to/venv-b

Prints each start's time to /health and the kernel libraries it wrote; exits 1 when a start after an
environment's first wrote one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

PORT = 18555


def libraries() -> dict[Path, float]:
    cache = Path(os.environ.get("CRANE_MP_CACHE", Path.home() / ".cache" / "crane-mp")) / "kernels"
    return {path: path.stat().st_mtime for path in cache.glob("*/*.so")}


def start(venv: str, log: Path) -> float:
    began = time.monotonic()
    proc = subprocess.Popen([f"{venv}/bin/crane-launch", "--demo", "--port", str(PORT)], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{venv}: the server exited:\n{log.read_text()[-2000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                    return time.monotonic() - began
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main(venvs: list[str]) -> int:
    seen, failed = set(), False
    with tempfile.TemporaryDirectory() as logs:
        for turn, venv in enumerate(venvs):
            before = libraries()
            ready = start(venv, Path(logs) / f"{turn}.log")
            written = sorted(p.parent.name for p, mtime in libraries().items() if before.get(p) != mtime)
            rebuilt = venv in seen and bool(written)
            failed |= rebuilt
            seen.add(venv)
            print(f"start {turn} ({venv}): ready in {ready:.1f} s; kernel libraries written: {written or 'none'}"
                  + ("  <- a rebuild" if rebuilt else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
