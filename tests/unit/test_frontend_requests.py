"""The frontend's request handling in-process (fake scheduler): what reaches the engine, what a client
gets for bad input, and that every request is unregistered however it ends."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from crane_mp.frontend.responses.schemas import TEXT_LOGPROBS
from crane_mp.frontend.serving import pipeline
from crane_mp.frontend.web.fields import INT64_MAX
from crane_mp.testing.make_model import make_model
from tests.unit.frontend_harness import start_frontend, stop_frontend

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture
async def frontend(model_dir, tmp_path):
    client, state, fake = await start_frontend(model_dir, tmp_path, MAX_MODEL_LEN)
    yield client, state, fake
    await stop_frontend(client, state)


async def test_max_tokens_is_clamped_to_what_the_context_leaves(frontend):
    client, state, fake = frontend
    prompt = list(range(3, 103))  # 100 tokens
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10**12, "min_tokens": 10**12})
    assert r.status == 200, await r.text()
    sampling = fake.requests[-1].sampling
    assert sampling.max_tokens == MAX_MODEL_LEN - 100 and sampling.min_tokens == MAX_MODEL_LEN - 100
    r = await client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 7}})
    assert r.status == 200 and fake.requests[-1].sampling.max_tokens == 7
    r = await client.post("/v1/completions", json={"prompt": list(range(MAX_MODEL_LEN)), "max_tokens": 1})
    assert r.status == 400 and "maximum context length is 256" in (await r.json())["error"]["message"]


async def test_extreme_seeds_with_n_reach_the_engine_intact(frontend):
    client, state, fake = frontend
    for seed in (INT64_MAX, -(2**63)):
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "seed": seed, "n": 16})
        assert r.status == 200, await r.text()
        assert [req.sampling.seed for req in fake.requests[-16:]] == [seed + i for i in range(16)]
    for body in ({"seed": INT64_MAX + 1}, {"top_k": 2**63}, {"logit_bias": {"²": 1}}, {"max_tokens": -5},
                 {"stop": ["x"] * 17}, {"temperature": 1e308}, {"logit_bias": {"600": 1}},
                 {"logit_bias": {"5\n": 1}}):
        r = await client.post("/v1/completions", json={"prompt": "hi", **body})
        error = (await r.json())["error"]
        assert r.status == 400 and error["param"] in body, (body, error)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "hi\xff", "max_tokens": 1}',
    b'{"prompt": "a", "chat_template_kwargs": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}]}",
])
async def test_bad_encodings_and_deep_nesting_are_400s(frontend, raw):
    client, state, fake = frontend
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/tokenize"):
        r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 400, (path, await r.text())
    deep: list = [1]
    for _ in range(20):
        deep = [deep]
    kwargs = {"enable_thinking": deep}
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "chat_template_kwargs": kwargs})
    assert r.status == 400 and (await r.json())["error"]["param"] == "chat_template_kwargs"


async def test_chat_template_kwargs_reach_only_the_templates_variables(frontend):
    client, state, fake = frontend
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = await (await client.post("/v1/tokenize", json={"messages": body["messages"]})).json()
    for kwargs in ({"messages": 1, "add_generation_prompt": "x", "eos_token": 3, "unknown": {}},):
        r = await client.post("/v1/tokenize", json={"messages": body["messages"], "chat_template_kwargs": kwargs})
        assert r.status == 200 and (await r.json())["tokens"] == plain["tokens"]
    thinking_off = {"messages": body["messages"], "chat_template_kwargs": {"enable_thinking": False}}
    assert (await (await client.post("/v1/tokenize", json=thinking_off)).json())["tokens"] != plain["tokens"]


async def test_a_prompt_over_the_window_is_refused_before_it_is_tokenized(frontend, monkeypatch):
    client, state, fake = frontend
    encoded: list[int] = []
    tokenizer = state.tokenizer.tokenizer
    original = tokenizer.encode

    def counting_encode(text, **kwargs):
        encoded.append(len(text))
        return original(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    huge = "word " * 200_000  # 1 MB, far over 256 tokens
    r = await client.post("/v1/completions", json={"prompt": huge})
    assert r.status == 400 and "at least" in (await r.json())["error"]["message"]
    assert encoded == []  # its length alone proved it too long
    # ~100K tokens in 300K characters: not provably too long by length for a window just above
    # 300K / longest token, so it is counted chunk by chunk, stopping once over.
    text = "ab " * 100_000
    window = len(text) // state.tokenizer.max_token_chars + 2
    state.engine_info = msgspec.structs.replace(state.engine_info, max_model_len=window)
    r = await client.post("/v1/completions", json={"prompt": text})
    assert r.status == 400 and "at least" in (await r.json())["error"]["message"]
    assert 0 < sum(encoded) < len(text)
    assert fake.requests == [] and state.client.streams == {}


async def test_body_limit_follows_the_context_window(frontend):
    client, state, fake = frontend
    assert state.max_request_bytes == 1 << 20  # 64 prompts x 256 tokens x 8 bytes is under the 1 MiB floor
    r = await client.post("/v1/completions", data=b" " * ((1 << 20) + 1), headers={"Content-Type": "application/json"})
    assert r.status == 413 and "--max-request-bytes" in (await r.json())["error"]["message"]


async def test_a_scheduler_refusal_is_a_400_and_an_engine_death_a_503(frontend):
    client, state, fake = frontend
    fake.reject_with = "the prompt is empty"
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status == 400 and (await r.json())["error"]["message"] == "the prompt is empty"
    fake.reject_with, fake.answer = None, False
    pending = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "hi"}))
    while not state.client.streams:
        await asyncio.sleep(0)
    state.client.fail_all("an engine process died")
    r = await pending
    assert r.status == 503 and state.client.streams == {}


async def test_every_request_is_unregistered_however_it_ends(frontend, monkeypatch):
    client, state, fake = frontend
    # Finished normally; stopped by a stop string (aborted in the engine).
    assert (await client.post("/v1/completions", json={"prompt": "hi", "n": 3})).status == 200
    fake.tokens_per_request = 30
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30, "stop": [state.tokenizer.decode([5])]})
    assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "stop"
    assert fake.aborts[-1] == fake.requests[-1].rid
    # A failure after registration (a bug while building the response).
    async def broken(*args):
        raise RuntimeError("bug")
    monkeypatch.setattr(pipeline, "collect", broken)
    assert (await client.post("/v1/completions", json={"prompt": "hi", "n": 2})).status == 500
    assert set(fake.aborts[-2:]) == {req.rid for req in fake.requests[-2:]}
    monkeypatch.undo()
    # A client that leaves a stream in the middle.
    fake.answer = False
    resp = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    rid = fake.requests[-1].rid
    resp.close()
    while rid not in fake.aborts:
        await asyncio.sleep(0.01)
    assert state.client.streams == {}


async def test_405_names_the_allowed_methods_and_openapi_declares_the_path_parameter(frontend):
    client, state, fake = frontend
    r = await client.put("/v1/completions")
    assert r.status == 405 and r.headers["Allow"] == "POST"
    doc = await (await client.get("/openapi.json")).json()
    [param] = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert param["name"] == "model_id" and param["in"] == "path"
    vocab = state.engine_info.vocab_size
    token = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token["maximum"] == vocab - 1
    assert json.dumps(doc)  # serialisable as is


async def test_two_generate_requests_sharing_a_rid_stay_abortable(frontend):
    client, state, fake = frontend
    fake.answer = False
    body = {"text": "hi", "rid": "shared", "sampling_params": {"max_new_tokens": 5}}
    first = asyncio.ensure_future(client.post("/generate", json=body))
    second = asyncio.ensure_future(client.post("/generate", json=body))
    while len(fake.requests) < 2:
        await asyncio.sleep(0.01)
    done_rid, other_rid = fake.requests[0].rid, fake.requests[1].rid
    fake._finish(fake.requests[0])  # the first one ends; the name must still reach the second
    assert (await first).status == 200
    r = await client.post("/abort_request", json={"rid": "shared"})
    assert r.status == 200 and other_rid in fake.aborts and done_rid not in fake.aborts
    assert (await (await second).json())["meta_info"]["finish_reason"]["type"] == "abort"
    assert state.client.streams == {}
    r = await client.post("/generate", json={"text": "hi", "model": "another-model"})
    assert r.status == 404


@pytest.mark.parametrize(("fields", "logprobs"), [({"top_logprobs": 3}, 3), ({"include": [TEXT_LOGPROBS]}, 0),
                                                  ({"include": ["reasoning.encrypted_content"]}, None)])
async def test_the_responses_api_asks_the_engine_for_the_logprobs_it_was_asked_for(frontend, fields, logprobs):
    client, state, fake = frontend
    r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **fields})
    assert r.status == 200, await r.text()
    assert fake.requests[-1].sampling.logprobs == logprobs
    assert (await r.json())["top_logprobs"] == fields.get("top_logprobs")
