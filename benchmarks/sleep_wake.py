"""Time to first token awake, after a level-1 sleep and after a level-2 sleep, and what each sleep frees.

    python benchmarks/sleep_wake.py --model-path PATH [--rounds 3 --prompt-tokens 128 --server-args "..."]

Starts crane-launch on PATH, warms it, then per round: a streamed request awake (its time to first
token), POST /sleep?level=1 then another (the wake-up is in its TTFT), then level 2 likewise; every
prompt is new (no prefix-cache hit: a sleep drops the cache, so awake ones must not find theirs).
Prints one JSON line: the median TTFT of each state, the worker's resident memory before and after
each sleep, and the seconds each /sleep took.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import psutil
import requests


def prompt_of(length: int, seed: int) -> list[int]:
    """A prompt no earlier one shares a block with: every state's TTFT computes it whole."""
    return [10 + (seed * 997 + 7 * i) % 4000 for i in range(length)]


def ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: ") and b'"text":""' not in line.replace(b" ", b""):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--server-args", default="")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    log = open("/tmp/sleep_wake_server.log", "w")
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", args.model_path, "--port", str(args.port),
           "--no-access-log", *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        worker = psutil.Process(int(re.search(r"started worker process pid=(\d+)",
                                              open("/tmp/sleep_wake_server.log").read()).group(1)))
        calls = iter(range(1, 10**6))
        for _ in range(2):
            ttft(url, prompt_of(args.prompt_tokens, next(calls)))  # warm: kernels, caches
        times: dict[str, list[float]] = {"awake": [], "level1": [], "level2": []}
        memory: dict[str, list[int]] = {"level1": [], "level2": []}
        sleep_seconds: dict[str, list[float]] = {"level1": [], "level2": []}
        for _ in range(args.rounds):
            times["awake"].append(ttft(url, prompt_of(args.prompt_tokens, next(calls))))
            for level in (1, 2):
                before = worker.memory_info().rss
                started = time.perf_counter()
                requests.post(url + "/sleep", params={"level": level}, timeout=600).raise_for_status()
                sleep_seconds[f"level{level}"].append(time.perf_counter() - started)
                memory[f"level{level}"].append(before - worker.memory_info().rss)
                times[f"level{level}"].append(ttft(url, prompt_of(args.prompt_tokens, next(calls))))
        print(json.dumps({
            "model": args.model_path, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
            "ttft_s": {state: round(statistics.median(values), 3) for state, values in times.items()},
            "freed_mib": {state: round(statistics.median(values) / 2**20, 1) for state, values in memory.items()},
            "sleep_call_s": {state: round(statistics.median(values), 3) for state, values in sleep_seconds.items()},
        }))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
