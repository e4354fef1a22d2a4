"""A burst far past capacity: how fast the refused get their 429, whether every accepted request
completes, and whether each process's memory comes back.

    python benchmarks/overload.py --model-path DIR --requests 2000 --max-queue 256

Starts crane-launch on the model (tiny: `python -m crane_mp.testing.make_model --arch qwen3 --size tiny
--out DIR`), warms it with one request, then sends --requests completions at once (half streaming,
16 tokens each, one connection each) and reports status counts, latency percentiles per status
(measured at the client, from the moment the burst starts: the client's own connection set-up is
included), and every process's RSS before the burst and 3 s after it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import subprocess
import sys
import time
import urllib.request

import aiohttp
import psutil


async def one(session: aiohttp.ClientSession, url: str, i: int, started: float) -> tuple[int, float, bool]:
    stream = i % 2 == 0
    body = {"prompt": f"burst {i}", "max_tokens": 16, "ignore_eos": True, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as response:
        text = await response.text()
    complete = response.status != 200 or (text.endswith("data: [DONE]\n\n") and '"error"' not in text
                                          if stream else '"usage"' in text)
    return response.status, time.monotonic() - started, complete


async def burst(url: str, count: int) -> list[tuple[int, float, bool]]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.monotonic()
        return await asyncio.gather(*(one(session, url, i, started) for i in range(count)))


def percentiles(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[int(q * (len(values) - 1))], 3) for q in (0.0, 0.5, 0.9, 0.99, 1.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--server-args", default="")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", args.model_path, "--port", str(args.port),
           "--max-queue", str(args.max_queue), "--no-access-log", *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if "ready in" in line:
                break
        pids = dict(re.findall(r"started (\S+) process pid=(\d+)", "".join(log)))
        procs = {name: psutil.Process(int(pid)) for name, pid in pids.items()}
        urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "warm"}',
                                                      headers={"Content-Type": "application/json"}), timeout=60)
        before = {name: p.memory_info().rss >> 20 for name, p in procs.items()}
        results = asyncio.run(burst(url, args.requests))
        time.sleep(3)
        after = {name: p.memory_info().rss >> 20 for name, p in procs.items()}
    finally:
        proc.terminate()
        proc.wait(60)
    by_status = collections.defaultdict(list)
    for status, elapsed, _ in results:
        by_status[status].append(elapsed)
    report = {
        "requests": args.requests, "max_queue": args.max_queue,
        "statuses": {status: len(times) for status, times in sorted(by_status.items())},
        "latency_s_min_p50_p90_p99_max": {status: percentiles(times) for status, times in sorted(by_status.items())},
        "incomplete": sum(not complete for _, _, complete in results),
        "rss_mib_before": before, "rss_mib_after": after,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
