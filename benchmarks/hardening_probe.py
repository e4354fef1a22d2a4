"""What a hostile client, a web page or a neighbour can do to a running server, and what it costs the
honest clients beside them (issue 28's figures).

    python benchmarks/hardening_probe.py --demo
    python benchmarks/hardening_probe.py --model-path DIR --server-args "--num-frontends 2"

Starts crane-launch on the model (no API key, default limits unless --server-args says otherwise) and
runs, one after another:

- refusals: run-time LoRA routes without the opt-in (404), a cross-site `text/plain` POST (415), a GET
  on a state-changing route (405), 1,024 generations in one request, 17 stop strings and prompt
  logprobs with n > 1 (400 each), a path with `%0a` in it (no forged access-log line);
- slow clients: --connections connections trickling their headers a byte a second for --trickle-seconds
  while an honest completion is sent every second (each must get 200 within 5 s);
- grammars: --streams streams decoding while --schemas requests each bring a new ~200 KB JSON schema;
  the streams' inter-token latency p50 and p99, against the same streams with no schema traffic;
- a GGUF file that claims 10^9 layers: time until crane-launch stops, and how many lines it printed.

Then every process's RSS against its RSS after warm-up, and /health. One JSON report on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import psutil


_PHASES = ("refusals", "slow-clients", "grammars", "gguf")


class Server:
    def __init__(self, cmd: list[str], url: str) -> None:
        self.url = url
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "ready in" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(600)
        if self.proc.poll() is not None:
            raise SystemExit("the server did not start:\n" + "".join(self.lines))
        pids = dict(re.findall(r"started (\S+) process pid=(\d+)", "".join(self.lines)))
        self.procs = {name: psutil.Process(int(pid)) for name, pid in pids.items()}

    def rss_mib(self) -> dict[str, int]:
        return {name: p.memory_info().rss >> 20 for name, p in self.procs.items()}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def refusals(session: aiohttp.ClientSession, server: Server) -> dict:
    url = server.url
    out = {}
    async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}) as r:
        out["load_lora_without_opt_in"] = r.status
    async with session.post(url + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": 1}',
                            headers={"Content-Type": "text/plain", "Origin": "https://evil.example"}) as r:
        out["text_plain_post"] = r.status
    async with session.get(url + "/flush_cache") as r:
        out["get_flush_cache"] = r.status
    async with session.post(url + "/v1/completions", json={"prompt": ["hi"] * 64, "n": 16, "max_tokens": 1}) as r:
        out["generations_1024"] = r.status
    async with session.post(url + "/v1/completions", json={"prompt": "hi", "stop": ["x"] * 17}) as r:
        out["stop_strings_17"] = r.status
    async with session.post(url + "/v1/completions",
                            json={"prompt": "hi", "n": 2, "echo": True, "logprobs": 5, "max_tokens": 1}) as r:
        out["prompt_logprobs_n2"] = r.status
    async with session.get(url + "/nope%0aFAKE%20LINE") as r:
        out["newline_in_path"] = r.status
    await asyncio.sleep(0.5)  # the access log line is written as the response ends
    out["forged_log_lines"] = sum(line.startswith("FAKE") for line in server.lines)
    return out


async def honest(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    started = time.monotonic()
    async with session.post(url + "/v1/completions", json={"prompt": "an honest request", "max_tokens": 4}) as r:
        await r.read()
    return r.status, time.monotonic() - started


async def slow_clients(session: aiohttp.ClientSession, url: str, connections: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 100
    closed = 0

    async def trickle() -> None:
        nonlocal closed
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            closed += 1
            return
        try:
            for byte in request[: int(seconds)]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1)
        except (ConnectionError, OSError):
            closed += 1
        finally:
            writer.close()

    tasks = [asyncio.create_task(trickle()) for _ in range(connections)]
    await asyncio.sleep(1)
    answers = []
    while not all(task.done() for task in tasks):
        answers.append(await honest(session, url))
        await asyncio.sleep(1)
    await asyncio.gather(*tasks)
    latencies = sorted(t for _, t in answers)
    return {"connections": connections, "seconds": seconds, "closed_by_server": closed,
            "honest_requests": len(answers), "honest_not_200": sum(s != 200 for s, _ in answers),
            "honest_latency_s_p50_max": [round(latencies[len(latencies) // 2], 3), round(latencies[-1], 3)]}


def big_schema(size: int) -> dict:
    """A JSON schema of about `size` bytes that no earlier request used."""
    tag = uuid.uuid4().hex[:8]
    properties, length = {}, 0
    while length < size:
        name = f"field_{tag}_{len(properties)}"
        properties[name] = {"type": "string", "maxLength": 8}
        length += len(name) + 40  # the name, quoted, and its 36-byte definition
    return {"type": "object", "properties": properties, "additionalProperties": False}


async def stream_gaps(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    body = {"prompt": "a stream that keeps decoding", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


async def grammars(session: aiohttp.ClientSession, url: str, streams: int, schemas: int, tokens: int) -> dict:
    async def run(with_schemas: bool) -> tuple[list[float], dict]:
        decoding = [asyncio.create_task(stream_gaps(session, url, tokens)) for _ in range(streams)]
        statuses: dict[int, int] = {}
        if with_schemas:
            for _ in range(schemas):
                body = {"prompt": "fill the form", "max_tokens": 8, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "form", "schema": big_schema(200_000)}}}
                async with session.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
        gaps = [gap for task in await asyncio.gather(*decoding) for gap in task]
        return gaps, statuses

    quiet, _ = await run(False)
    busy, statuses = await run(True)
    figures = {}
    for name, gaps in (("quiet", quiet), ("schemas", busy)):
        p50, p99 = np.percentile(gaps, [50, 99])
        figures[name] = {"itl_ms_p50": round(p50 * 1e3, 1), "itl_ms_p99": round(p99 * 1e3, 1),
                         "p99_over_p50": round(p99 / p50, 2)}
    return {"streams": streams, "schema_requests": schemas, "schema_statuses": statuses, **figures}


def billion_layers(workdir: Path) -> dict:
    import gguf

    path = workdir / "billion-layers.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(10**9)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(path)],
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    return {"exit_code": run.returncode, "seconds": round(time.monotonic() - started, 2), "lines": len(lines),
            "message": lines[-1] if lines else ""}


async def probe(server: Server, args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await honest(session, server.url)  # warm-up
        await stream_gaps(session, server.url, 8)
        rss_start = server.rss_mib()
        # Structured output loads its view of the vocabulary on first use (once per server).
        async with session.post(server.url + "/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}}) as r:
            await r.read()
        await asyncio.sleep(2)
        rss_grammar_ready = server.rss_mib()
        report = {}
        if "refusals" in args.phases:
            report["refusals"] = await refusals(session, server)
        if "slow-clients" in args.phases:
            report["slow_clients"] = await slow_clients(session, server.url, args.connections, args.trickle_seconds)
        if "grammars" in args.phases:
            report["grammars"] = await grammars(session, server.url, args.streams, args.schemas, args.tokens)
        await asyncio.sleep(3)
        rss_end = server.rss_mib()
        report["rss_mib_start_grammars_end"] = {
            name: [rss_start[name], rss_grammar_ready[name], rss_end[name], round(rss_end[name] / rss_start[name], 3)]
            for name in rss_start}
        async with session.get(server.url + "/health") as r:
            report["health_after"] = r.status
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-path")
    model.add_argument("--demo", action="store_true")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--phases", default=",".join(_PHASES), type=lambda text: text.split(","),
                        help="which probes to run, of " + ",".join(_PHASES))
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--trickle-seconds", type=float, default=20)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--schemas", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="tokens each measured stream decodes")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    source = ["--demo"] if args.demo else ["--model-path", args.model_path]
    server = Server([sys.executable, "-m", "crane_mp", *source, "--port", str(args.port),
                     *args.server_args.split()], url)
    try:
        report = asyncio.run(probe(server, args))
    finally:
        server.stop()
    if "gguf" in args.phases:
        with tempfile.TemporaryDirectory() as workdir:
            report["billion_layer_gguf"] = billion_layers(Path(workdir))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
