"""What a web page, a client or a neighbour can send, in-process over the fake scheduler: only JSON
POSTs reach a handler, state-changing routes take the admin key, run-time LoRA routes exist only when
asked for and load only from under --lora-root, and no path can forge an access-log line."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import subprocess
import sys
import threading

import pytest

from crane_mp.config import EngineConfig
from crane_mp.frontend.web.access_log import MalformedRequests
from crane_mp.logs import TextFormatter
from crane_mp.protocol import FinishReason, TokenLogprobs, TokenOutput
from tests.unit.frontend_harness import start_frontend, stop_frontend


@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
    {"Origin": "https://evil.example"},  # a browser's body of no declared type
])
async def test_what_a_web_page_can_post_without_a_preflight_is_refused(frontend, headers):
    client, state, fake = frontend
    for path in ("/v1/completions", "/generate", "/flush_cache"):
        r = await client.post(path, data=b'{"prompt": "hi", "text": "hi"}', headers=headers,
                              skip_auto_headers=("Content-Type",))
        assert r.status == 415, (path, await r.text())
        assert (await r.json())["error"]["code"] == 415
    assert fake.requests == []


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "Application/JSON", "Origin": "http://127.0.0.1:8080"}])
async def test_json_and_bare_bodies_from_scripts_are_served(frontend, headers):
    client, state, fake = frontend
    r = await client.post("/v1/completions", data=b'{"prompt": "hi", "max_tokens": 2}', headers=headers,
                          skip_auto_headers=("Content-Type",))  # as requests.post(data=...) sends it
    assert r.status == 200, await r.text()


async def test_state_changing_routes_are_post_only(frontend):
    client, state, fake = frontend
    assert (await client.get("/flush_cache")).status == 405


@pytest.mark.parametrize("server_args", [{"admin_api_key": "adm"}])
async def test_the_admin_key_guards_what_changes_server_state(frontend):
    client, state, fake = frontend
    admin = {"Authorization": "Bearer adm"}
    assert (await client.post("/abort_request", json={"rid": "x"})).status == 401
    assert (await client.post("/abort_request", json={"rid": "x"}, headers=admin)).status == 200
    assert (await client.post("/flush_cache")).status == 401
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200  # no --api-key: the other routes stay open


@pytest.mark.parametrize("server_args", [{"api_key": "user", "admin_api_key": "adm"}])
async def test_the_user_key_opens_no_admin_route(frontend):
    client, state, fake = frontend
    user = {"Authorization": "Bearer user"}
    assert (await client.post("/abort_request", json={"rid": "x"}, headers=user)).status == 401
    assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=user)).status == 200


async def test_run_time_lora_routes_do_not_exist_unless_asked_for(frontend):
    client, state, fake = frontend
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"})
    assert r.status == 404
    assert "/v1/load_lora_adapter" not in (await (await client.get("/openapi.json")).json())["paths"]


@pytest.fixture
def lora_root(tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    return root


async def test_adapters_load_only_from_under_the_lora_root(model_dir, tmp_path, lora_root):
    engine = EngineConfig(model_path=str(model_dir), runtime_lora=True, lora_root=str(lora_root))
    client, state, fake = await start_frontend(model_dir, tmp_path, 256, engine=engine)
    try:
        (lora_root / "out").symlink_to(tmp_path)
        for path in ("/etc", "../", "out/m", str(tmp_path / "secret")):
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path})
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "lora_path", body
            assert "--lora-root" in body["error"]["message"] and path not in body["error"]["message"]
        assert "/v1/load_lora_adapter" in (await (await client.get("/openapi.json")).json())["paths"]
    finally:
        await stop_frontend(client, state)


def test_run_time_lora_needs_a_root_directory(tmp_path):
    with pytest.raises(ValueError, match="needs lora_root"):
        EngineConfig(model_path="m", runtime_lora=True)
    with pytest.raises(ValueError, match="needs lora_root"):
        EngineConfig(model_path="m", runtime_lora=True, lora_root=str(tmp_path / "missing"))


async def test_a_path_cannot_forge_an_access_log_line(frontend, caplog):
    client, state, fake = frontend
    caplog.set_level(logging.INFO, logger="crane_mp.access")
    r = await client.get("/nope%0aFAKE%20LINE%0d")
    assert r.status == 404
    [record] = [r for r in caplog.records if r.name == "crane_mp.access"]
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "%0a" in line.lower()


async def test_a_malformed_request_gets_400_and_no_traceback_in_the_log(frontend, caplog):
    client, state, fake = frontend
    server_log = logging.getLogger("aiohttp.server")
    server_log.addFilter(quiet := MalformedRequests())
    try:
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Probe: \x00\r\n\r\n")
        assert b" 400 " in await asyncio.wait_for(reader.readline(), 30)
        writer.close()
    finally:
        server_log.removeFilter(quiet)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (await client.get("/health")).status == 200


@pytest.mark.parametrize("server_args", [{"max_request_generations": 4}])
async def test_one_request_starts_a_bounded_number_of_generations(frontend):
    client, state, fake = frontend
    r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "n" and "--max-request-generations" in body["error"]["message"]
    r = await client.post("/generate", json={"text": ["a", "b", "c", "d", "e"], "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 400
    assert fake.requests == []
    r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert r.status == 200 and len(fake.requests) == 4


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "echo": True, "logprobs": 1, "n": 2, "max_tokens": 2},
    {"prompt": "hi", "stop": "x" * 257},
    {"prompt": "hi", "stop": ["x"] * 17},
])
async def test_requests_whose_work_grows_without_bound_are_refused(frontend, body):
    client, state, fake = frontend
    r = await client.post("/v1/completions", json=body)
    assert r.status == 400, await r.text()
    assert fake.requests == []


async def test_a_listener_that_dies_fails_what_waits_and_turns_health_to_503(frontend, caplog):
    client, state, fake = frontend
    fake.answer = False  # admitted, then left waiting for tokens
    waiting = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}))

    async def sent() -> None:
        while not fake.requests:
            await asyncio.sleep(0)

    await asyncio.wait_for(sent(), 30)

    async def broken_listener() -> None:
        raise RuntimeError("boom")

    state.client._listen = broken_listener
    state.client.start()
    r = await asyncio.wait_for(waiting, 30)
    assert r.status == 503, await r.text()
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "engine_dead"
    assert (await client.post("/v1/completions", json={"prompt": "hi"})).status == 503
    assert any("engine listener stopped" in r.getMessage() for r in caplog.records)


async def _trickle(client, path: str = "/v1/completions"):
    """A connection that sends its headers and the first byte of a 100-byte body, then nothing."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n{".encode())
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("server_args", [{"max_queue": 1, "read_timeout": 0.5}])
async def test_trickling_uploads_hold_no_place_in_the_gate_and_time_out(model_dir, tmp_path, frontend):
    client, state, fake = frontend
    assert state.gate.limit == state.config.engine.max_num_seqs + 1
    slow = [await _trickle(client) for _ in range(state.gate.limit + 2)]
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200 and state.gate.in_flight == 0
    for reader, writer in slow:  # each gets its 408 once --read-timeout passed
        status_line = await asyncio.wait_for(reader.readline(), 30)
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        writer.close()
    assert len(fake.requests) == 1


async def _connections_open(state, count: int) -> None:
    while len(state.connections.open) < count:  # the server accepts in its own turn of the loop
        await asyncio.sleep(0)


@pytest.mark.parametrize("server_args", [{"max_connections": 2}])
async def test_connections_past_the_cap_get_503_and_the_others_are_served(frontend):
    client, state, fake = frontend
    held = [await asyncio.open_connection(client.server.host, client.server.port) for _ in range(2)]
    await asyncio.wait_for(_connections_open(state, 2), 30)
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 503")
    assert b'"code": 503' in await asyncio.wait_for(reader.read(), 30)  # then the server closes it
    writer.close()
    assert state.connections.refused == 1 and len(state.connections.open) == 2

    for _, held_writer in held:
        held_writer.close()
    while state.connections.open:
        await asyncio.sleep(0)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200


@pytest.mark.parametrize("server_args", [{"read_timeout": 0.5}])
async def test_headers_that_trickle_past_the_read_timeout_get_408(frontend):
    client, state, fake = frontend
    slow = []
    for _ in range(20):
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        slow.append((reader, writer))
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200
    for reader, writer in slow:
        assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 408")
        await asyncio.wait_for(reader.read(), 30)  # closed by the server
        writer.close()
    assert len(fake.requests) == 1


@pytest.mark.parametrize("server_args", [{"write_timeout": 0.2}])
async def test_a_stream_nobody_reads_is_dropped_and_its_request_aborted(frontend):
    client, state, fake = frontend
    fake.answer = False
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    body = b'{"prompt": "hi", "stream": true, "max_tokens": 200}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()

    async def aborted() -> None:
        while not fake.requests:
            await asyncio.sleep(0)
        rid = fake.requests[0].rid
        sent = 0
        while rid not in fake.aborts:  # tokens keep coming; the client reads none of them
            stream = state.client.streams.get(rid)
            if stream is not None:
                stream.push(TokenOutput(rid, [300] * 20_000, 2, sent + 20_000))
                sent += 20_000
            await asyncio.sleep(0.01)

    await asyncio.wait_for(aborted(), 60)
    assert state.client.streams == {}
    writer.close()


@pytest.mark.parametrize("server_args", [{"grammar_timeout": 0.05, "max_request_bytes": 4 << 20}])
async def test_grammars_compile_within_a_deadline_and_a_size(frontend):
    client, state, fake = frontend
    busy = threading.Event()
    state.grammars._pool.submit(busy.wait)  # the compiler's one thread is taken by a schema that never ends
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    try:
        r = await client.post("/v1/completions", json={"prompt": "hi", "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    finally:
        busy.set()
    body = await r.json()
    assert r.status == 400 and "--grammar-timeout" in body["error"]["message"], body
    assert body["error"]["param"] == "response_format.json_schema.schema"
    r = await client.post("/generate", json={"text": "hi", "sampling_params": {"regex": "a" * ((1 << 20) + 1)}})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "sampling_params.regex", body
    assert fake.requests == []


async def test_streamed_logprobs_grow_chunk_by_chunk_and_equal_what_was_sampled(frontend):
    """SGLang's framing repeats the lists whole in every chunk; they are extended, not rebuilt, and the
    last chunk holds every token's entry once, in order."""
    client, state, fake = frontend
    fake.answer = False
    response = asyncio.ensure_future(client.post("/generate", json={
        "text": "hi", "stream": True, "return_logprob": True, "top_logprobs_num": 1,
        "sampling_params": {"max_new_tokens": 6}}))

    async def sent() -> None:
        while not fake.requests or fake.requests[0].rid not in state.client.streams:
            await asyncio.sleep(0)

    await asyncio.wait_for(sent(), 30)
    rid = fake.requests[0].rid
    stream = state.client.streams[rid]
    steps = [[300, 301], [302], [303, 304, 305]]
    done = 0
    for i, ids in enumerate(steps):
        logprobs = [TokenLogprobs(-0.5 - done - j, [token], [-0.5 - done - j]) for j, token in enumerate(ids)]
        done += len(ids)
        finish = FinishReason.LENGTH if i == len(steps) - 1 else None
        stream.push(TokenOutput(rid, ids, 2, done, finish, logprobs=logprobs))
        await asyncio.sleep(0)
    r = await asyncio.wait_for(response, 30)
    chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: {")]
    lengths = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    last = chunks[-1]["meta_info"]
    assert [entry[1] for entry in last["output_token_logprobs"]] == list(range(300, 306))
    assert [entry[0] for entry in last["output_token_logprobs"]] == [-0.5 - k for k in range(6)]
    assert [top[0][1] for top in last["output_top_logprobs"]] == list(range(300, 306))


async def test_prompt_logprobs_held_for_one_request_are_bounded(frontend, monkeypatch):
    from crane_mp.frontend.serving import pipeline

    # The real bound is a batch of 64 lm-eval contexts of 2k tokens, eight times over; this frontend's
    # context window is 256 tokens, so the test scales it down with the prompts.
    monkeypatch.setattr(pipeline, "MAX_PROMPT_LOGPROB_ENTRIES", 64 * 200 * 2)
    client, state, fake = frontend
    prompts = [[5] * 200] * 64  # 64 x 200 positions x (1 + 20) entries: above the bound
    r = await client.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 1})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "prompt" and "entries" in body["error"]["message"], body
    assert fake.requests == []
    r = await client.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1})
    assert r.status == 200


def test_the_file_descriptor_limit_is_lifted_for_the_connection_cap():
    code = ("import resource; from crane_mp.frontend.web.connections import raise_fd_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))\n"
            "raise_fd_limit(1024)\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    soft, hard = map(int, run.stdout.split())
    assert soft == (1024 + 256 if hard == resource.RLIM_INFINITY else min(1024 + 256, hard))
