"""crane-mp at --tensor-parallel-size 1 against 2 (or more) on the same model, in one run.

    python benchmarks/tensor_parallel.py                                  # the small benchmark model, made here
    python benchmarks/tensor_parallel.py --model-path /models/qwen3-8b-q4_k_m.gguf --concurrency 1 4 --sizes 1 2

For each size, in rounds that alternate the sizes (this host's speed drifts minute to minute): each
rank's weights (/server_info), each worker rank's resident memory after the load, and output tok/s
and ITL at each concurrency (serving.py's load generator: streaming /v1/completions, token-id prompts,
EOS ignored). On CPU the ranks split the cores, so more ranks are not more arithmetic: what the
split buys there is memory per rank (and NUMA locality on a multi-socket host); on GPUs it is the
memory and bandwidth of N devices. Prints one JSON line per measurement and a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vs_llama import load, machine, wait_ready  # noqa: E402

from crane_mp.testing.make_model import make_model  # noqa: E402


def worker_rss(proc: subprocess.Popen) -> list[int]:
    """Resident bytes of each worker rank (the server's children named crane-worker), by pid order."""
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "crane-worker"]
    return [p.memory_info().rss for p in sorted(workers, key=lambda p: p.pid)]


def measure(size: int, args, round_index: int) -> list[dict]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(args.model_path), "--port", str(args.port),
           "--tensor-parallel-size", str(size), *args.crane_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        wait_ready(url, proc)
        ready = time.monotonic() - started
        info = requests.get(url + "/server_info", timeout=30).json()
        rows = []
        for concurrency in args.concurrency:
            result = load(url, concurrency, max(4, 2 * concurrency), args.prompt_len, args.output_len,
                          seed=concurrency + 100 * round_index, llama=False)
            rows.append({"bench": "tensor_parallel", "round": round_index, "tp": size, "concurrency": concurrency,
                         "ready_s": round(ready, 1),
                         "rank_weights_mib": [round(r["weights_bytes"] / 2**20, 1) for r in info["ranks"]],
                         "rank_rss_mib": [round(b / 2**20) for b in worker_rss(proc)],
                         "output_tok_s": result["output_tok_s"], "itl_p50_ms": result["itl_p50_ms"],
                         "ttft_p50_ms": result["ttft_p50_ms"], "errors": result["errors"]})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="default: the small benchmark model (make_model), made here")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--crane-args", nargs=argparse.REMAINDER, default=[], help="more crane-launch flags")
    args = parser.parse_args()
    print(f"# machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.model_path is None:
            args.model_path = make_model("qwen3", "small", Path(scratch) / "small", seed=0)
        rows = [row for index in range(args.rounds) for size in args.sizes for row in measure(size, args, index)]
    print(f"\n{'tp':>3} {'C':>3} {'tok/s (each round)':>24} {'ITL p50 ms':>16} {'weights MiB per rank':>24} "
          f"{'RSS MiB per rank':>20}")
    for size in args.sizes:
        for concurrency in args.concurrency:
            mine = [r for r in rows if r["tp"] == size and r["concurrency"] == concurrency]
            print(f"{size:>3} {concurrency:>3} {' / '.join(str(r['output_tok_s']) for r in mine):>24} "
                  f"{' / '.join(str(r['itl_p50_ms']) for r in mine):>16} {str(mine[0]['rank_weights_mib']):>24} "
                  f"{str(mine[-1]['rank_rss_mib']):>20}")


if __name__ == "__main__":
    main()
