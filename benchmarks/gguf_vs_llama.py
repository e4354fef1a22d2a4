"""crane-mp against llama.cpp's llama-server on the same GGUF files, side by side in one run.

    python benchmarks/gguf_vs_llama.py FILE.gguf [FILE.gguf ...] [--llama-server PATH] [--concurrency 1 32]

For each file and each concurrency: start crane-launch on the file, measure with serving.py's load
generator (streaming /v1/completions, 128-token id prompts, 128 output tokens, EOS ignored), stop it;
then the same for llama-server (-np 32, same threads, OMP_WAIT_POLICY=PASSIVE as ../shared/peers
advises). Prints one JSON line per measurement and a table at the end. Nothing else should run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from serving import run_load  # noqa: E402

DEFAULT_LLAMA = Path.home() / "peers/llama/build/bin/llama-server"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server not ready")


def start(server: str, path: Path, port: int, args) -> subprocess.Popen:
    if server == "crane-mp":
        cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(path), "--port", str(port),
               "--max-concurrent", "32", *args.crane_args]
        env = dict(os.environ)
    else:
        cmd = [str(args.llama_server), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c", "16384",
               "-np", "32", "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000, help="prompt token ids are drawn below this")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--servers", nargs="+", default=["crane-mp", "llama-server"])
    parser.add_argument("--crane-args", nargs=argparse.REMAINDER, default=[], help="extra crane-launch flags (last)")
    args = parser.parse_args()
    rows = []
    for path in args.files:
        for server in args.servers:
            proc = start(server, path, args.port, args)
            url = f"http://127.0.0.1:{args.port}"
            try:
                wait_ready(url, proc)
                for concurrency in args.concurrency:
                    load = SimpleNamespace(
                        url=url, concurrency=concurrency, request_rate=None, seed=0, vocab=args.vocab,
                        num_requests=max(4, concurrency * args.requests_per_stream), prompt_len=args.prompt_len,
                        output_len=args.output_len, new_connection=server == "llama-server",
                    )
                    result = asyncio.run(run_load(load))
                    result.update(server=server, file=path.name)
                    print(json.dumps(result), flush=True)
                    rows.append(result)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"\n{'file':<28} {'server':<13} {'C':>3} {'tok/s':>8} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'errors':>6}")
    for r in rows:
        print(f"{r['file']:<28} {r['server']:<13} {r['concurrency']:>3} {r['output_tok_s']:>8} {r['ttft_p50_ms']:>12} "
              f"{r['itl_p50_ms']:>11} {r['errors']:>6}")


if __name__ == "__main__":
    main()
