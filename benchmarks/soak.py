"""Hours of mixed traffic in minutes: does every request come back, does every KV block, and does each
process's memory stay where the plan put it?

    python benchmarks/soak.py --launch-demo --minutes 12 --concurrency 16
    python benchmarks/soak.py --launch-model qwen3-0.6b-q4_k_m.gguf --minutes 12
    python benchmarks/soak.py --url http://127.0.0.1:8080 --server-pid PID --minutes 12

--concurrency clients each send one request after another, from a mix taken in a fixed order: chat and
completions, whole and streamed, `n=2`, logprobs, stop strings, a JSON schema, SGLang `/generate`, and
one stream in eight dropped by the client after its first chunk. Every --sample-seconds it records
each server process's resident memory (crane-launch names its children crane-worker,
crane-scheduler, crane-frontendN). When the time is up it waits for the server to fall idle and
reports requests by kind and status, transport errors, the KV blocks still in use, RSS over time, and
the bound issue 33 sets: the worker's RSS at the end at most its idle RSS (before the traffic) plus the
plan's activation reserve plus 256 MiB, and under 2 % of growth over the last half of the run
(--warmup-rounds first, for a run too short for its warm-up to be a small part of it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import psutil

MIB = 1 << 20
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "required": ["name", "age"], "additionalProperties": False}
_WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls count stars in the night".split()
KINDS = ("chat", "chat_stream", "completion", "completion_stream", "n2", "logprobs", "stop", "json_schema",
         "generate", "generate_stream", "dropped_stream")
_WEIGHTS = (3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 2)  # one request in eight (2 of 18) is a dropped stream
# Requests take their kinds from this sequence in turn, across all clients: every 18 requests hold
# each kind, however few a slow machine sends.
ORDER = random.Random(0).sample([kind for kind, weight in zip(KINDS, _WEIGHTS) for _ in range(weight)],
                                sum(_WEIGHTS))


PROMPT_WORDS = [4, 120]  # each prompt's length is drawn between these (--prompt-words)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*PROMPT_WORDS)))


def request_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    """(path, body) of one request of `kind`."""
    tokens = rng.randint(4, 48)
    messages = [{"role": "user", "content": _prompt(rng)}]
    if kind in ("chat", "chat_stream", "dropped_stream"):
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": tokens,
                                        "temperature": rng.choice([0.0, 0.7, 1.0]),
                                        "stream": kind != "chat"}
    if kind in ("completion", "completion_stream"):
        return "/v1/completions", {"model": model, "prompt": _prompt(rng), "max_tokens": tokens,
                                   "stream": kind == "completion_stream", "temperature": 0.8, "top_p": 0.9}
    if kind == "n2":
        return "/v1/completions", {"model": model, "prompt": _prompt(rng), "max_tokens": tokens, "n": 2,
                                   "temperature": 1.0, "seed": rng.randint(0, 1 << 30)}
    if kind == "logprobs":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": tokens,
                                        "logprobs": True, "top_logprobs": 5}
    if kind == "stop":
        return "/v1/completions", {"model": model, "prompt": _prompt(rng), "max_tokens": tokens,
                                   "stop": [rng.choice(_WORDS), "\n\n", "."], "temperature": 1.0}
    if kind == "json_schema":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 64,
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "person", "schema": _SCHEMA}}}
    if kind in ("generate", "generate_stream"):
        return "/generate", {"text": _prompt(rng), "stream": kind == "generate_stream",
                             "sampling_params": {"max_new_tokens": tokens, "temperature": 0.5}}
    raise ValueError(kind)


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.transport_errors: collections.Counter = collections.Counter()
        self.incomplete: collections.Counter = collections.Counter()

    def report(self) -> dict:
        answered = sum(sum(c.values()) for c in self.statuses.values())
        return {"requests": self.sent, "lost": self.sent - answered - sum(self.transport_errors.values()),
                "statuses": {kind: dict(sorted(c.items())) for kind, c in sorted(self.statuses.items())},
                "server_errors": sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500),
                "transport_errors": dict(self.transport_errors), "incomplete": dict(self.incomplete)}


async def one(session: aiohttp.ClientSession, url: str, kind: str, body_path: tuple[str, dict], tally: Tally) -> None:
    path, body = body_path
    tally.sent += 1
    try:
        async with session.post(url + path, json=body) as response:
            if kind == "dropped_stream" and response.status == 200:
                await response.content.readany()  # the first chunk, then the client goes away
                response.close()
            else:
                text = await response.text()
                if response.status == 200 and not complete(body.get("stream", False), text):
                    tally.incomplete[kind] += 1
        tally.statuses[kind][response.status] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        tally.transport_errors[f"{kind}: {type(err).__name__}"] += 1


def complete(stream: bool, text: str) -> bool:
    if not stream:
        return text.startswith("{") and '"error"' not in text[:20]
    return "[DONE]" in text[-64:] and '"error"' not in text


async def client(url: str, model: str, seed: int, tally: Tally, deadline: float = float("inf"),
                 count: int | None = None) -> None:
    """Requests one after another until `deadline`, or `count` of them."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sent = 0
        while time.monotonic() < deadline and (count is None or sent < count):
            kind = ORDER[tally.sent % len(ORDER)]
            await one(session, url, kind, request_for(kind, rng, model), tally)
            sent += 1


def rss_by_name(root: psutil.Process | None) -> dict[str, int]:
    """Resident bytes of each crane-mp process: the children of `root`, or every crane-* process."""
    procs = root.children(recursive=True) if root is not None else list(psutil.process_iter())
    found = {}
    for proc in procs:
        try:
            name = proc.name()
            if name.startswith("crane-"):
                found[name] = proc.memory_info().rss
        except psutil.Error:
            continue
    return found


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def wait_idle(url: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = get_json(url + "/server_info")["stats"]
        if (stats["active_sequences"] == 0 and stats["waiting_sequences"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


async def soak(url: str, model: str, seconds: float, concurrency: int, sample_seconds: float,
               root: psutil.Process | None,
               warmup_rounds: int = 0) -> tuple[Tally, list[tuple[float, dict[str, int]]]]:
    """The first sample is the idle server's, before any traffic (the bound's base); warm-up rounds
    (every client through the whole mix) come before the timed run, whose samples follow."""
    tally = Tally()
    idle = rss_by_name(root)
    if warmup_rounds:
        await asyncio.gather(*(client(url, model, 1000 + seed, tally, count=warmup_rounds * len(ORDER))
                               for seed in range(concurrency)))
    started = time.monotonic()
    deadline = started + seconds
    samples = [(0.0, idle), (0.0, rss_by_name(root))]
    clients = asyncio.gather(*(client(url, model, seed, tally, deadline) for seed in range(concurrency)))
    while time.monotonic() < deadline:
        await asyncio.sleep(min(sample_seconds, max(0.0, deadline - time.monotonic())))
        samples.append((time.monotonic() - started, rss_by_name(root)))
    await clients
    return tally, samples


def launch(args) -> tuple[subprocess.Popen, str]:
    source = ["--demo"] if args.launch_demo else ["--model-path", args.launch_model]
    cmd = [sys.executable, "-m", "crane_mp", *source, "--port", str(args.port), "--no-access-log",
           *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stderr.write(line)
        if "ready in" in line:
            break
    else:
        raise SystemExit("the server exited before it was ready")
    # Keep reading its output: a full pipe would block the server's next log line.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, f"http://127.0.0.1:{args.port}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch-demo", action="store_true", help="start crane-launch --demo and stop it after")
    where.add_argument("--launch-model", help="start crane-launch --model-path this and stop it after")
    where.add_argument("--url", help="a running server (its processes: --server-pid, else every crane-* process)")
    parser.add_argument("--server-pid", type=int, help="crane-launch's pid, with --url")
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--server-args", default="", help="more crane-launch flags, with --launch-*")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=PROMPT_WORDS, metavar=("MIN", "MAX"))
    parser.add_argument("--warmup-rounds", type=int, default=0,
                        help="before the timed run, each client sends the whole mix this many times: the growth "
                             "over the run's last half then measures a warm server (a short run's would be warm-up)")
    parser.add_argument("--idle-seconds", type=float, default=5.0,
                        help="wait this long after the server falls idle before the last sample")
    args = parser.parse_args(argv)
    PROMPT_WORDS[:] = args.prompt_words

    server = None
    if args.url:
        url, root = args.url.rstrip("/"), psutil.Process(args.server_pid) if args.server_pid else None
    else:
        server, url = launch(args)
        root = psutil.Process(server.pid)
    try:
        info = get_json(url + "/server_info")
        model = get_json(url + "/v1/models")["data"][0]["id"]
        tally, samples = asyncio.run(soak(url, model, 60 * args.minutes, args.concurrency, args.sample_seconds,
                                          root, args.warmup_rounds))
        stats = wait_idle(url)
        time.sleep(args.idle_seconds)
        stats = get_json(url + "/server_info")["stats"]
        after_idle = rss_by_name(root)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    report = summarize(tally, samples, after_idle, stats, info)
    print(json.dumps(report, indent=1))
    return report


def summarize(tally: Tally, samples: list[tuple[float, dict[str, int]]], after_idle: dict[str, int], stats: dict,
              info: dict) -> dict:
    names = sorted({name for _, rss in samples for name in rss})
    worker = [rss.get("crane-worker", 0) for _, rss in samples]
    half = samples[-1][0] / 2
    middle = next((rss.get("crane-worker", 0) for t, rss in samples if t >= half), worker[-1])
    activation = info.get("activation_bytes", 0)
    bound = worker[0] + activation + 256 * MIB
    return {
        **tally.report(),
        "kv_blocks_in_use_when_idle": stats["kv_blocks_used"],
        "rss_mib": {name: [[round(t), round(rss.get(name, 0) / MIB)] for t, rss in samples] for name in names},
        "rss_mib_idle_after": {name: round(rss / MIB) for name, rss in sorted(after_idle.items())},
        "worker": {"idle_before_mib": round(worker[0] / MIB), "end_mib": round(worker[-1] / MIB),
                   "activation_reserve_mib": round(activation / MIB), "bound_mib": round(bound / MIB),
                   "within_bound": worker[-1] <= bound,
                   "growth_last_half": round((worker[-1] - middle) / max(1, middle), 4)},
    }


if __name__ == "__main__":
    main()
