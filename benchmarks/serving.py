"""Load generator for any OpenAI-compatible server (crane-mp, vLLM, llama-server): what a streaming
client sees, measured at the client from SSE arrival times.

    python benchmarks/serving.py --url http://127.0.0.1:8080                    # C = 1, 8, 32, 64
    python benchmarks/serving.py --url http://127.0.0.1:8000 --concurrency 32 --num-requests 64
    python benchmarks/serving.py --url ... --prefix-len 1000 --prompt-len 64 --concurrency 32  # shared prefix
    python benchmarks/serving.py --launch-demo --server-args "--no-prefix-cache"  # starts crane-launch --demo
    python benchmarks/serving.py --url ... --concurrency 32 --extra-body '{"guided_regex": "[a-z ]+"}'  # constrained

Closed loop at each --concurrency (or open loop at --request-rate, Poisson arrivals). Streaming
/v1/completions with token-id prompts, EOS ignored, so every request produces exactly --output-len
tokens. With --prefix-len P every prompt starts with the same P tokens (a shared system prompt) and
ends with --prompt-len unique ones; the server's cache is flushed first (/flush_cache, where there is
one) so the first wave pays for the prefix.

Reported per run: output tok/s; TTFT p50/p99; ITL p50/p99, the gaps between SSE events as the client
receives them; tokens per event (mean, max), counted from usage on every chunk where the server sends
it (crane-mp, vLLM), else one per event (llama-server); TPOT p50 (per request, (latency - TTFT) /
(tokens - 1)); cached prompt tokens (from usage.prompt_tokens_details where reported). One JSON line
per run, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between consecutive events with text
    event_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int,
                      extra_body: dict | None = None) -> RequestRecord:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **(extra_body or {})}
    record = RequestRecord()
    reported = 0  # completion tokens according to the last usage seen
    start = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = details["cached_tokens"]
                has_text = bool(chunk.get("choices") and chunk["choices"][0].get("text"))
                if usage and usage.get("completion_tokens") is not None:
                    count = usage["completion_tokens"] - reported
                    reported = usage["completion_tokens"]
                else:
                    count = 1 if has_text else 0  # servers without usage per chunk send a token per event
                if not has_text or count <= 0:
                    continue
                record.output_tokens += count
                record.event_tokens.append(count)
                if record.ttft == 0.0:
                    record.ttft = now - start
                else:
                    record.gaps.append(now - last)
                last = now
        record.latency = time.perf_counter() - start
        record.output_tokens = max(record.output_tokens, reported)
        record.ok = record.output_tokens == output_len
        if not record.ok:
            record.error = f"got {record.output_tokens} tokens"
    except aiohttp.ClientError as err:
        record.error = repr(err)
    return record


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(10, args.vocab) for _ in range(getattr(args, "prefix_len", 0))]
    return [prefix + [rng.randrange(10, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]


async def run_load(args) -> dict:
    prompts = make_prompts(args)
    rng = random.Random(args.seed + 1)
    # llama-server closes keep-alive connections that aiohttp would reuse: --new-connection avoids them.
    connector = aiohttp.TCPConnector(limit=0, force_close=args.new_connection)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm = [rng.randrange(10, args.vocab) for _ in range(8)]
        await one_request(session, args.url, warm, 4)
        async with session.get(args.url + "/server_info") as resp:
            info = await resp.json() if resp.status == 200 else {}
        if getattr(args, "prefix_len", 0):
            async with session.post(args.url + "/flush_cache") as resp:
                await resp.read()
        start = time.perf_counter()
        if args.request_rate:
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(one_request(session, args.url, prompt, args.output_len,
                                                                      args.extra_body)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            records = await asyncio.gather(*tasks)
        else:
            queue = list(reversed(prompts))
            records = []

            async def client():
                while queue:
                    records.append(await one_request(session, args.url, queue.pop(), args.output_len,
                                                      args.extra_body))

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    events = [n for r in ok for n in r.event_tokens]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "bench": "serving",
        "isa": f"{info.get('isa')}/{info.get('kernel_isa')}" if info else None,
        "concurrency": args.concurrency if not args.request_rate else None,
        "request_rate": args.request_rate,
        "num_requests": len(records),
        "prefix_len": getattr(args, "prefix_len", 0),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "errors": len(records) - len(ok),
        "duration_s": round(elapsed, 2),
        "output_tok_s": round(sum(r.output_tokens for r in ok) / elapsed, 1),
        "ttft_p50_ms": round(percentile([r.ttft for r in ok], 0.5) * 1e3, 1),
        "ttft_p99_ms": round(percentile([r.ttft for r in ok], 0.99) * 1e3, 1),
        "itl_p50_ms": round(percentile(gaps, 0.5) * 1e3, 1),
        "itl_p99_ms": round(percentile(gaps, 0.99) * 1e3, 1),
        "tpot_p50_ms": round(percentile(tpot, 0.5) * 1e3, 1),
        "tokens_per_event_mean": round(sum(events) / len(events), 2) if events else None,
        "tokens_per_event_max": max(events, default=None),
        "cached_tokens_mean": round(sum(cached) / len(cached), 1) if cached else None,
        "first_error": next((r.error for r in records if not r.ok), None),
    }


def launch_demo(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "crane_mp", "--demo", "--port", str(args.port), *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(args.url + "/health", timeout=1).status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the demo server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--request-rate", type=float, help="requests/s, Poisson arrivals (open loop)")
    parser.add_argument("--num-requests", type=int, help="per run (default: 2 per stream, at least 4)")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt shares at its start")
    parser.add_argument("--prompt-len", type=int, default=128, help="unique prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="added to each result (e.g. the server's name)")
    parser.add_argument("--launch-demo", action="store_true", help="start crane-launch --demo on --port first")
    parser.add_argument("--server-args", default="", help="extra crane-launch flags with --launch-demo")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--new-connection", action="store_true", help="one connection per request (for llama-server)")
    parser.add_argument("--extra-body", type=json.loads, default={},
                        help='JSON merged into every request, e.g. \'{"guided_regex": "[a-z ]+"}\' (structured output)')
    args = parser.parse_args()

    proc = None
    if args.launch_demo:
        args.url = f"http://127.0.0.1:{args.port}"
        proc = launch_demo(args)
    rows = []
    try:
        for concurrency in args.concurrency:
            run = argparse.Namespace(**vars(args))
            run.concurrency = concurrency
            run.num_requests = args.num_requests or max(4, 2 * concurrency)
            run.seed = args.seed + concurrency  # fresh prompts per run: no cache hits from the run before
            result = {"label": args.label, **asyncio.run(run_load(run))}
            print(json.dumps(result), flush=True)
            rows.append(result)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"\n{'label':<12} {'C':>3} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'tok/event':>9} {'max':>4} {'cached':>7} {'errors':>6}")
    for r in rows:
        print(f"{r['label']:<12} {r['concurrency']!s:>3} {r['output_tok_s']:>8} {r['ttft_p50_ms']:>9} "
              f"{r['ttft_p99_ms']:>9} {r['itl_p50_ms']:>8} {r['itl_p99_ms']:>8} {r['tokens_per_event_mean']!s:>9} "
              f"{r['tokens_per_event_max']!s:>4} {r['cached_tokens_mean']!s:>7} {r['errors']:>6}")


if __name__ == "__main__":
    main()
