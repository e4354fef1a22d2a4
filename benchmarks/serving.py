"""Load generator for an OpenAI-compatible server: output tok/s, req/s, TTFT and inter-token latency.

    python benchmarks/serving.py --url http://127.0.0.1:8080 --concurrency 32 --num-requests 64
    python benchmarks/serving.py --launch-demo --concurrency 32 --compare-engine   # server vs in-process

Closed loop at --concurrency, or open loop at --request-rate (Poisson arrivals). Streaming
/v1/completions with token-id prompts of --prompt-len and EOS ignored, so every request produces
exactly --output-len tokens. Prints a table and one JSON line. itl is the time per output token after
the first (TPOT, per request); chunk_gap is the time between SSE chunks, which carry up to
--decode-tokens-per-seq tokens each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> RequestRecord:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    record = RequestRecord()
    counted_usage, chunk_tokens = False, 0
    start = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}"
                return record
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    counted_usage = True
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if not counted_usage:  # servers without stream usage (llama-server) send one token per chunk
                        chunk_tokens += 1
                    now = time.perf_counter()
                    if record.ttft == 0.0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
        record.latency = time.perf_counter() - start
        if not counted_usage:
            record.output_tokens = chunk_tokens
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


async def run_load(args) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    # llama-server closes keep-alive connections that aiohttp would reuse: --new-connection avoids them.
    connector = aiohttp.TCPConnector(limit=0, force_close=args.new_connection)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await one_request(session, args.url, prompts[0][:8], 4)  # warm-up
        async with session.get(args.url + "/server_info") as resp:
            info = await resp.json() if resp.status == 200 else {}
        async with session.get(args.url + "/model_info") as resp:
            info["dtype"] = (await resp.json()).get("dtype") if resp.status == 200 else None
        start = time.perf_counter()
        if args.request_rate:
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(one_request(session, args.url, prompt, args.output_len)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            records = await asyncio.gather(*tasks)
        else:
            queue = list(prompts)
            records = []

            async def client():
                while queue:
                    records.append(await one_request(session, args.url, queue.pop(), args.output_len))

            await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    chunk_gaps = [x for r in ok for x in r.itl]
    # Time per output token after the first: what a reader of a stream sees on average.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "bench": "serving",
        "isa": f"{info.get('isa')}/{info.get('kernel_isa')}",
        "dtype": info.get("dtype"),
        "concurrency": args.concurrency if not args.request_rate else None,
        "request_rate": args.request_rate,
        "num_requests": len(records),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "errors": len(records) - len(ok),
        "duration_s": round(elapsed, 2),
        "output_tok_s": round(tokens / elapsed, 1),
        "req_s": round(len(ok) / elapsed, 2),
        "ttft_p50_ms": round(percentile([r.ttft for r in ok], 0.5) * 1e3, 1),
        "ttft_p99_ms": round(percentile([r.ttft for r in ok], 0.99) * 1e3, 1),
        "itl_p50_ms": round(percentile(tpot, 0.5) * 1e3, 1),
        "itl_p99_ms": round(percentile(tpot, 0.99) * 1e3, 1),
        "chunk_gap_p50_ms": round(percentile(chunk_gaps, 0.5) * 1e3, 1),
        "chunk_gap_p99_ms": round(percentile(chunk_gaps, 0.99) * 1e3, 1),
        "first_error": next((r.error for r in records if not r.ok), None),
    }


def engine_throughput(model_path: str, args) -> float:
    """The in-process engine on the same workload (same checkpoint, same settings), in a child process
    so that its threads do not compete with the server's."""
    code = (
        "import json, random, sys, time\n"
        "from crane_mp.config import EngineConfig\n"
        "from crane_mp.engine import LLMEngine\n"
        "from crane_mp.protocol import SamplingParams\n"
        f"eng = LLMEngine(EngineConfig(model_path={model_path!r}, max_num_seqs={args.concurrency}, "
        f"max_num_batched_tokens=2048, decode_tokens_per_seq={args.decode_tokens_per_seq}))\n"
        f"rng = random.Random({args.seed})\n"
        f"prompts = [[rng.randrange(10, {args.vocab}) for _ in range({args.prompt_len})] for _ in range({args.num_requests})]\n"
        f"params = SamplingParams(temperature=0.0, max_tokens={args.output_len}, ignore_eos=True)\n"
        "eng.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))\n"
        "start = time.perf_counter()\n"
        f"for i in range(0, len(prompts), {args.concurrency}):\n"
        f"    eng.generate(prompts[i:i + {args.concurrency}], params)\n"
        f"print(json.dumps({args.num_requests} * {args.output_len} / (time.perf_counter() - start)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def launch_demo(args) -> tuple[subprocess.Popen, str]:
    from crane_mp.testing.demo import demo_model_path

    path = str(demo_model_path())
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", path, "--port", str(args.port),
           "--max-concurrent", str(args.concurrency), "--decode-tokens-per-seq", str(args.decode_tokens_per_seq)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    for _ in range(600):
        try:
            if urllib.request.urlopen(args.url + "/health", timeout=1).status == 200:
                return proc, path
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the demo server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--request-rate", type=float, help="requests/s, Poisson arrivals (open loop)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch-demo", action="store_true", help="start crane-launch --demo on --port first")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--decode-tokens-per-seq", type=int, default=16)
    parser.add_argument("--compare-engine", action="store_true", help="also run the in-process engine (same workload)")
    parser.add_argument("--new-connection", action="store_true", help="one connection per request (for llama-server)")
    args = parser.parse_args()

    proc = None
    model_path = None
    if args.launch_demo:
        args.url = f"http://127.0.0.1:{args.port}"
        proc, model_path = launch_demo(args)
    try:
        result = asyncio.run(run_load(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.compare_engine and model_path:
        engine = engine_throughput(model_path, args)
        result["engine_tok_s"] = round(engine, 1)
        result["server_vs_engine"] = round(result["output_tok_s"] / engine, 3)
    print(json.dumps(result))
    for key, value in result.items():
        print(f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
