"""What operators rely on, in-process over the fake scheduler: request ids, the access log, load
shedding with 429, connections refused past the cap, request timeouts, and errors that name the request."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.protocol import EngineState, ErrorKind, LoraAdapter, LoraRegistry
from tests.unit.frontend_harness import start_frontend, stop_frontend


def access_records(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "crane_mp.access"]


async def test_request_ids_are_honoured_returned_and_made_up_when_missing(frontend):
    client, state, fake = frontend
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "job-42/a"})
    assert r.status == 200 and r.headers["X-Request-Id"] == "job-42/a"
    assert "job-42/a" in fake.requests[-1].names
    body = await r.json()
    assert body["id"] in fake.requests[-1].names  # the OpenAI id aborts it too
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "has space"})
    assert r.headers["X-Request-Id"] != "has space" and len(r.headers["X-Request-Id"]) == 32
    r = await client.get("/nowhere", headers={"X-Request-Id": "lost-1"})
    assert r.status == 404 and r.headers["X-Request-Id"] == "lost-1"


async def test_one_access_line_per_request_without_the_prompt(frontend, caplog):
    client, state, fake = frontend
    caplog.set_level(logging.INFO, logger="crane_mp.access")
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "secret words"}]},
                      headers={"X-Request-Id": "c1"})
    await client.post("/generate", json={"text": "secret words", "sampling_params": {"n": 2, "max_new_tokens": 2}})
    await client.post("/v1/completions", json={"prompt": "secret words", "max_tokens": "x"})
    chat, generate, bad = access_records(caplog)
    assert chat["request_id"] == "c1" and chat["route"] == "/v1/chat/completions" and chat["status"] == 200
    assert chat["completion_tokens"] == 2 and chat["prompt_tokens"] > 2 and chat["finish_reason"] == "length"
    assert chat["ttft"] is not None and chat["total_time"] >= chat["ttft"] and chat["model"] == "tiny"
    assert generate["completion_tokens"] == 4 and generate["route"] == "/generate"
    assert bad["status"] == 400 and bad["model"] is None and bad["finish_reason"] is None
    assert "secret" not in caplog.text and all("prompt" not in r for r in (chat, generate, bad))


@pytest.mark.parametrize("server_args", [{"log_requests": True}])
async def test_log_requests_adds_the_prompt_text(frontend, caplog):
    client, state, fake = frontend
    caplog.set_level(logging.INFO, logger="crane_mp.access")
    await client.post("/v1/completions", json={"prompt": "secret words"})
    [record] = access_records(caplog)
    assert record["prompt"] == "secret words"


async def test_the_gate_sheds_with_429_and_counts_rejections(model_dir, tmp_path):
    client, state, fake = await start_frontend(model_dir, tmp_path, 256, max_queue=1,
                                      engine=EngineConfig(model_path=str(model_dir), max_num_seqs=1))
    try:
        fake.answer = False  # admitted and left running
        first = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
        second = await client.post("/v1/completions", json={"prompt": "b", "stream": True})
        assert first.status == second.status == 200
        r = await client.post("/v1/completions", json={"prompt": "c"})
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["type"] == "rate_limit_error" and len(fake.requests) == 2
        metrics = await (await client.get("/metrics")).text()
        assert 'crane:requests_rejected_total{model_name="tiny",replica="127.0.0.1:8080"} 1.0' in metrics
        first.close()
        second.close()
    finally:
        await stop_frontend(client, state)


async def test_a_scheduler_refusal_of_a_stream_is_still_an_http_status(frontend):
    client, state, fake = frontend
    fake.reject_with, fake.reject_kind = "the server is overloaded", ErrorKind.OVERLOADED
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status == 429 and r.headers["Retry-After"] == "1"
    r = await client.post("/generate", json={"text": "x", "stream": True})
    assert r.status == 429
    fake.reject_with, fake.reject_kind = "kaboom", ErrorKind.INTERNAL
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "r-9"})
    assert r.status == 500 and (await r.json())["error"]["message"] == "kaboom (request id r-9)"
    assert state.client.streams == {}


@pytest.mark.parametrize("server_args", [{"request_timeout": 0.2}])
async def test_a_request_past_its_deadline_ends_with_408_and_is_aborted(frontend):
    client, state, fake = frontend
    fake.answer = False  # the engine never finishes it
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status == 408 and "--request-timeout" in (await r.json())["error"]["message"]
    assert fake.aborts == [fake.requests[-1].rid]
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
    assert r.status == 200 and events[-1]["error"]["code"] == 408
    assert fake.aborts[-1] == fake.requests[-1].rid and state.client.streams == {}


@pytest.mark.parametrize("server_args", [{"max_connections": 2}])
async def test_refused_connections_are_counted_and_logged_at_most_once_a_second(frontend, caplog):
    client, state, fake = frontend
    caplog.set_level(logging.INFO, logger="crane_mp.access")
    host, port = client.server.host, client.server.port
    held = [await asyncio.open_connection(host, port) for _ in range(2)]
    while len(state.connections.open) < 2:  # the server accepts in its own turn of the loop
        await asyncio.sleep(0)
    for _ in range(3):
        reader, writer = await asyncio.open_connection(host, port)
        assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 503")
        writer.close()

    def refusals() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "crane_mp.access" and "refused" in r.fields]

    async def all_logged() -> None:  # the last ones wait for their line, a second after the first
        while sum(r.fields["refused"] for r in refusals()) < 3:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(all_logged(), 30)
    lines = refusals()
    assert lines[0].fields == {"status": 503, "refused": 1} and lines[0].levelno == logging.WARNING
    assert all(later.created - earlier.created > 0.9 for earlier, later in zip(lines, lines[1:]))
    for _, writer in held:
        writer.close()
    while state.connections.open:
        await asyncio.sleep(0)
    metrics = await (await client.get("/metrics")).text()
    assert 'crane:connections_refused_total{model_name="tiny",replica="127.0.0.1:8080"} 3.0' in metrics


@pytest.mark.parametrize("task", ["generate", "embed", "score"])
async def test_model_info_says_is_generation_only_for_a_generating_server(model_dir, tmp_path, task):
    """True only where the generation routes serve: an embedding or scoring server (as a transcription one)
    refuses them."""
    from safetensors.torch import save_file

    served = tmp_path / "model"
    shutil.copytree(model_dir, served)
    save_file({"score.weight": torch.ones(1, 64)}, str(served / "score.safetensors"))  # a one-label head
    client, state, fake = await start_frontend(served, tmp_path / "run", 256,
                                               engine=EngineConfig(model_path=str(served), task=task))
    try:
        for path in ("/model_info", "/get_model_info"):
            assert (await (await client.get(path)).json())["is_generation"] is (task == "generate")
    finally:
        await stop_frontend(client, state)


async def test_a_state_announced_before_a_question_answers_it(frontend):
    """Several frontends each hear of a sleep on their own socket: one asked right after another put the
    model to sleep applies what the scheduler sent it before answering (an H200 host's two frontends
    answered "awake" after a sleep)."""
    client, state, fake = frontend
    fake.announced = EngineState(2, "/models/tiny")
    assert await (await client.get("/is_sleeping")).json() == {"is_sleeping": True, "level": 2}
    assert (await (await client.get("/v1/models")).json())["data"][0]["state"] == "sleeping"
    fake.announced = EngineState(0, "/models/tiny")
    assert (await (await client.get("/v1/models/tiny")).json())["state"] == "loaded"


async def test_an_adapter_announced_before_a_request_serves_it(frontend):
    """An adapter loaded through another frontend: a request naming it catches up before its 404."""
    client, state, fake = frontend
    fake.announced = LoraRegistry([LoraAdapter(7, "sql", "/adapters/sql")])
    r = await client.post("/v1/completions", json={"model": "sql", "prompt": "a", "max_tokens": 2})
    assert r.status == 200, await r.text()
    assert (await r.json())["model"] == "sql" and fake.requests[-1].sampling.lora_id == 7
    r = await client.post("/v1/completions", json={"model": "nothing", "prompt": "a"})
    assert r.status == 404 and "`sql`" in (await r.json())["error"]["message"]
