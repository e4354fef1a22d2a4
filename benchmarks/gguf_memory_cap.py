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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
        print("PASS" if results and not failed and alive else "FAIL",
              f"({len(results)} runs, errors: {[r['first_error'] for r in failed]}, server up: {alive})")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
