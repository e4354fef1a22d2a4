"""The real three-process server on a tiny model: exactness, streaming, aborts, preemption, faults, drain."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import psutil
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", "tiny", tmp_path_factory.mktemp("m") / "llama", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # float32 KV: greedy tokens are compared with transformers' float32 (a bf16 cache, the default on
    # AVX512-BF16 CPUs, flips a near tie of this random model)
    srv = Server(model_dir, "--max-concurrent", "32", "--kv-cache-dtype", "float32",
                 log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def greedy(prompt_ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NUM_TOKENS,
                              min_new_tokens=NUM_TOKENS, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    return greedy, tokenizer


def prompts() -> list[list[int] | str]:
    gen = torch.Generator().manual_seed(11)
    ids = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    return ids + ["Hello there", "The quick brown fox", "Ünïcödé 日本語 test", "a"]


async def complete(session, url, prompt, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def greedy_through_server(url: str) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(complete(session, url, p) for p in prompts()))


def assert_matches_reference(results, reference) -> None:
    greedy, tokenizer = reference
    for prompt, result in zip(prompts(), results):
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert result["prompt_token_ids"] == prompt_ids
        assert result["choices"][0]["token_ids"] == greedy(prompt_ids)
        usage = dict(result["usage"])
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]
        assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": NUM_TOKENS,
                         "total_tokens": len(prompt_ids) + NUM_TOKENS}
        assert 0 <= cached < len(prompt_ids) and cached % 16 == 0  # whole blocks, never the last token
        assert result["choices"][0]["finish_reason"] == "length"


def test_concurrent_greedy_completions_match_transformers(server, reference):
    assert_matches_reference(asyncio.run(greedy_through_server(server.url)), reference)


def test_lossless_under_repeated_preemption(model_dir, reference, tmp_path):
    # float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one
    tight = Server(model_dir, "--max-total-tokens", "128", "--max-concurrent", "8", "--kv-cache-dtype", "float32",
                   log_path=tmp_path / "log")
    try:
        results = asyncio.run(tight.all_queued(greedy_through_server(tight.url), len(prompts())))
        assert_matches_reference(results, reference)
        assert tight.stats()["num_preemptions"] > 0
    finally:
        assert tight.stop() == 0


async def stream(session, url, max_tokens, cut_after=None, on_chunk=None) -> tuple[list[dict], bool]:
    """One seeded completion stream; `on_chunk()` is called after each chunk arrives."""
    body = {"prompt": "count with me", "max_tokens": max_tokens, "temperature": 0.7, "seed": 1,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = [], False
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
            if on_chunk is not None:
                on_chunk()
            if cut_after is not None and len(chunks) >= cut_after:
                break  # leaving the context closes the connection mid-stream
    return chunks, done


def test_64_streams_then_20_cut_streams_free_their_blocks(server):
    idle = server.stats()
    assert idle["num_free_blocks"] == idle["num_total_blocks"]

    async def run():
        async with aiohttp.ClientSession() as session:
            full = await asyncio.gather(*(stream(session, server.url, 20 + i % 7) for i in range(64)))
            for i, (chunks, done) in enumerate(full):
                assert done
                usage = chunks[-1]["usage"]
                assert chunks[-1]["choices"] == []
                assert usage["completion_tokens"] == 20 + i % 7
                assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            await asyncio.gather(*(stream(session, server.url, 1000, cut_after=2) for _ in range(20)))

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while (stats := server.stats())["num_free_blocks"] != idle["num_free_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["num_free_blocks"] == idle["num_free_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200


def test_stream_text_equals_non_stream_text_and_stop_strings(server):
    body = {"prompt": "Hello", "max_tokens": 30, "temperature": 0.9, "seed": 42, "ignore_eos": True}
    whole = requests.post(server.url + "/v1/completions", json=body, timeout=30).json()
    text = whole["choices"][0]["text"]
    chunks, _ = asyncio.run(_one_stream(server.url, {**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    stop = text[5:8]
    if stop.strip() and "\ufffd" not in stop:
        stopped = requests.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=30).json()
        choice = stopped["choices"][0]
        assert choice["text"] == text[: text.index(stop)]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


async def _one_stream(url, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            chunks = []
            async for line in resp.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
            return chunks, True


def test_chat_completion_shape(server):
    r = requests.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5, "temperature": 0})
    body = r.json()
    assert r.status_code == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 5


@pytest.mark.parametrize("body, status", [
    ({"prompt": "x", "max_tokens": "many"}, 400),
    ({"prompt": [5] * 2048, "max_tokens": 1}, 400),  # the prompt fills the 2048-token window
    ({"prompt": "x", "max_tokens": -5}, 400),
    ({"prompt": "x", "seed": 2**64}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "bogus_field": 1}, 400),
    ({"prompt": "x", "model": "not-this-one"}, 404),
    ({"prompt": [999999]}, 400),
    ({}, 400),
])
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, body, status):
    r = requests.post(server.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert requests.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1}, timeout=10).ok


def test_a_20_mb_prompt_is_refused_at_once_and_the_frontend_keeps_its_memory(server):
    frontend = psutil.Process(server.pids["frontend"])
    baseline = frontend.memory_info().rss
    huge = json.dumps({"prompt": "lorem ipsum " * 1_750_000}).encode()  # 21 MB
    assert requests.post(server.url + "/v1/completions", data=huge, timeout=30).status_code == 413
    # Without a Content-Length the limit still holds while the body is read.
    chunks = (huge[i : i + 65536] for i in range(0, len(huge), 65536))
    assert requests.post(server.url + "/v1/completions", data=chunks, timeout=30).status_code == 413
    # Under the byte limit but far over the context window: refused before it is tokenized.
    r = requests.post(server.url + "/v1/completions", json={"prompt": "lorem ipsum " * 80_000}, timeout=30)
    assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
    assert frontend.memory_info().rss - baseline < 200 << 20


def _start_streams(url: str, n: int, started: asyncio.Semaphore):
    """n long streams; each releases `started` once, at its first chunk."""
    async def one(session):
        first = []

        def on_chunk():
            if not first:
                first.append(True)
                started.release()

        try:
            chunks, done = await stream(session, url, 1500, on_chunk=on_chunk)
            errors = [c for c in chunks if "error" in c]
            return "error" if errors else ("done" if done else "cut")
        except aiohttp.ClientError:
            return "error"

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await asyncio.gather(*(one(session) for _ in range(n)))

    return run


def kill_9_during_streams(srv: Server, victim: str, n: int = 4) -> tuple[list[str], float]:
    """SIGKILL of one of the server's processes once `n` streams are generating: each stream's outcome
    ("error", "done" or "cut") and the seconds from the kill until the last one ended."""
    async def scenario():
        started = asyncio.Semaphore(0)
        task = asyncio.create_task(_start_streams(srv.url, n, started)())
        for _ in range(n):
            await started.acquire()  # every stream is generating
        killed = time.monotonic()
        psutil.Process(srv.pids[victim]).send_signal(signal.SIGKILL)
        outcomes = await task
        return outcomes, time.monotonic() - killed

    return asyncio.run(scenario())


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_kill_9_of_an_engine_process_fails_every_client_and_stops_the_server(model_dir, tmp_path, victim):
    srv = Server(model_dir, log_path=tmp_path / "log")
    try:
        tree = srv.process_tree()
        outcomes, elapsed = kill_9_during_streams(srv, victim)
        # No client waits for its own timeout (30 s): the failure reaches every stream at once.
        assert outcomes == ["error"] * 4 and elapsed < 10.0
        assert srv.proc.wait(5) != 0
        time.sleep(0.2)
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.kill_all()


def test_sigterm_drains_in_flight_requests_then_exits_zero(model_dir, tmp_path):
    srv = Server(model_dir, "--shutdown-grace", "300", log_path=tmp_path / "log")
    tree = srv.process_tree()
    try:
        async def scenario():
            async with aiohttp.ClientSession() as session:
                # Nearly the whole context window, one token per step: it is still generating long after
                # the drain has begun, on any machine.
                first_chunk = asyncio.Event()
                task = asyncio.create_task(stream(session, srv.url, 2000, on_chunk=first_chunk.set))
                await first_chunk.wait()
                srv.proc.send_signal(signal.SIGTERM)
                while await _health_status(session, srv.url) != "draining":
                    await asyncio.sleep(0.02)
                assert not task.done()
                async with session.post(srv.url + "/v1/completions", json={"prompt": "x"}) as late:
                    late_status = late.status
                return await task, late_status

        (chunks, done), late_status = asyncio.run(scenario())
        assert done and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert late_status == 503
        assert srv.proc.wait(300) == 0
        time.sleep(0.2)
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.kill_all()


def test_sigterm_after_a_burst_of_refused_requests_finds_nothing_in_flight(model_dir, tmp_path):
    # Every refused request must be unregistered: a leaked one would hold the drain for the whole grace.
    srv = Server(model_dir, "--shutdown-grace", "300", log_path=tmp_path / "log")
    try:
        bad = [b'{"prompt": "x", "seed": 18446744073709551616}', b'{"prompt": "hi\xff"}',
               rb'{"prompt": "x", "logit_bias": {"\u00b2": 1}}', b'{"prompt": "x", "n": 2, "top_k": 9223372036854775808}',
               b'{"messages": [{"role": "user", "content": "x", "y": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
               b'{"prompt": [5, 99999999]}', b'{"prompt": "' + b"ab " * 300_000 + b'"}']
        for raw in bad * 5:
            for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
                r = requests.post(srv.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
                assert 400 <= r.status_code < 500, (path, raw[:80], r.text)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill_all()


async def _health_status(session, url: str) -> str:
    async with session.get(url + "/health") as resp:
        return (await resp.json())["status"]


def test_bad_flags_fail_at_once_naming_the_flag(model_dir):
    for args, flag in [(["--port", "http"], "--port"), (["--gpu-memory-limit", "lots"], "--gpu-memory-limit"),
                       (["--max-concurrent", "0"], "--max-concurrent")]:
        result = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(model_dir), *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert flag in result.stderr.strip().splitlines()[-1]
