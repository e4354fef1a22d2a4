"""An 8B-shape Q4_K_M GGUF served under a hard memory cap with long concurrent streams (issue 15's
"Qwen3-8B-Q4_K_M.gguf with --gpu-memory-limit 8G, at least 8 concurrent 2k-token streams").

    python benchmarks/gguf_memory_cap.py                      # makes /tmp/random-qwen3-8b-q4_k_m.gguf once
    python benchmarks/gguf_memory_cap.py --gguf FILE --limit 8G --streams 8 --prompt-len 2000

Starts crane-launch on the file with the cap, prints the worker's memory plan (/server_info), then runs
benchmarks/serving.py at --streams concurrency with --prompt-len-token prompts. Every request must
finish without an error, and the server must still be up at the end. The weights are random
(crane_mp/testing/random_gguf.py): the memory and time are an 8B model's, the text is not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from crane_mp.config import parse_memory_limit
from crane_mp.testing.random_gguf import random_gguf

HERE = Path(__file__).parent


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 900) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"crane-launch exited with {proc.returncode} before serving")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("crane-launch did not become healthy")


class DevicePeak:
    """The device's used memory (nvidia-smi, every process on it: on a dedicated GPU, the worker's CUDA
    context, torch's reserved segments, cuBLAS workspaces and Triton modules) sampled every 0.2 s."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if shutil.which("nvidia-smi"):
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if out:
                self.peak_mib = max(self.peak_mib, int(out[0]))

    def stop(self) -> int:
        self._stop.set()
        return self.peak_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=Path("/tmp/random-qwen3-8b-q4_k_m.gguf"))
    parser.add_argument("--limit", default="8G")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--server-args", default="", help="more crane-launch flags")
    args = parser.parse_args()
    if not args.gguf.exists():
        print("writing", random_gguf(args.gguf, "8b", "Q4_K_M"))
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(args.gguf), "--gpu-memory-limit", args.limit,
           "--max-concurrent", str(args.streams), "--max-seq-len", str(args.prompt_len + args.output_len + 16),
           "--port", str(args.port), *args.server_args.split()]
    peak = DevicePeak()
    server = subprocess.Popen(cmd)
    try:
        wait_healthy(url, server)
        info = json.load(urllib.request.urlopen(url + "/server_info"))
        print(json.dumps({key: info.get(key) for key in ("weight_types", "weights_bytes", "weights_file_bytes",
                                                          "kv_bytes_per_token", "kv_budget_bytes")}, indent=1))
        run = subprocess.run([sys.executable, str(HERE / "serving.py"), "--url", url, "--concurrency",
                              str(args.streams), "--num-requests", str(2 * args.streams), "--prompt-len",
                              str(args.prompt_len), "--output-len", str(args.output_len)], capture_output=True,
                             text=True)
        print(run.stdout[-3000:])
        results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        failed = [r for r in results if r.get("first_error")]
        alive = server.poll() is None and urllib.request.urlopen(url + "/health", timeout=5).status == 200
        peak_mib = peak.stop()
        limit = parse_memory_limit(args.limit)
        limit_mib = limit.num_bytes / 2**20 if limit.num_bytes else None
        print(f"device memory peak (nvidia-smi): {peak_mib} MiB; limit {limit_mib} MiB")
        under = limit_mib is None or peak_mib <= limit_mib
        print("PASS" if results and not failed and alive and under else "FAIL",
              f"({len(results)} runs, errors: {[r['first_error'] for r in failed]}, server up: {alive}, "
              f"peak under the limit: {under})")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
