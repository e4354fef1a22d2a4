"""What the router of a several-model server costs a request: the same model served alone and behind the
router (beside a second model), one stream at a time, side by side in one run.

    python benchmarks/router_overhead.py --model-path PATH [--other PATH --requests 20 --tokens 64]

Per server: --requests streamed completions of --tokens tokens each (a new 32-token prompt each, one
after another), and --requests non-streamed one-token completions. Prints one JSON line: the medians of
time to first token, of a one-token request's latency, and the streams' decode tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import requests


def start(args: list[str], port: int, log: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "crane_mp", *args, "--port", str(port), "--no-access-log"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        assert proc.poll() is None, f"the server exited: see {log}"
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def measure(url: str, model: str, count: int, tokens: int) -> dict[str, float]:
    ttfts, rates, latencies = [], [], []
    for index in range(count + 2):  # the first two warm the server
        prompt = [10 + (index * 131 + 7 * i) % 4000 for i in range(32)]
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        started = time.perf_counter()
        first = None
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data: ") and first is None:
                    first = time.perf_counter()
        done = time.perf_counter()
        started_one = time.perf_counter()
        requests.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                      timeout=600).raise_for_status()
        if index >= 2:
            ttfts.append(first - started)
            rates.append((tokens - 1) / (done - first))
            latencies.append(time.perf_counter() - started_one)
    return {"ttft_ms": round(1000 * statistics.median(ttfts), 2), "one_token_ms": round(1000 * statistics.median(
        latencies), 2), "decode_tok_s": round(statistics.median(rates), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--other", help="the second model beside it (default: the same checkpoint again)")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8095)
    args = parser.parse_args()
    results = {}
    for label, server_args in (
            ("alone", ["--model-path", args.model_path, "--model-name", "m"]),
            ("behind the router", ["--model-path", f"m={args.model_path}",
                                   "--model-path", f"other={args.other or args.model_path}"])):
        proc = start(server_args, args.port, f"/tmp/router_overhead_{label.split()[0]}.log")
        try:
            results[label] = measure(f"http://127.0.0.1:{args.port}", "m", args.requests, args.tokens)
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps({"model": args.model_path, "tokens": args.tokens, **results}))


if __name__ == "__main__":
    main()
