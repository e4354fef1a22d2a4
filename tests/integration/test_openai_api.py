"""The OpenAI surface driven by the official `openai` SDK (sync, async, streaming) and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

KEY = "test-key-123"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # float32 KV: the scoring test compares logprobs with transformers' float32 to 1e-4.
    srv = Server(model_dir, "--api-key", KEY, "--max-request-bytes", "200000", "--kv-cache-dtype", "float32",
                 log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def test_chat_shapes_n_and_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       n=3, temperature=0.9, seed=4, logprobs=True, top_logprobs=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    assert [c.index for c in r.choices] == [0, 1, 2]
    # The tiny Qwen3 thinks (its template takes enable_thinking): a random answer is reasoning until </think>.
    assert len({(getattr(c.message, "reasoning_content", None), c.message.content) for c in r.choices}) > 1
    for choice in r.choices:
        assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_concatenates_to_the_non_stream_text(client, model):
    kwargs = dict(model=model, messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "go"}],
                  max_tokens=20, temperature=0.8, seed=11)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    message = whole.choices[0].message
    assert (thought, text) == (getattr(message, "reasoning_content", None) or "", message.content or "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_equivalence_and_continuous_usage(client, model):
    kwargs = dict(model=model, prompt="Once upon", max_tokens=15, temperature=1.0, seed=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    usages = [c.usage.completion_tokens for c in chunks if c.choices]
    assert usages == sorted(usages) and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_async_client_concurrent(server, model):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        results = await asyncio.gather(*(
            aclient.completions.create(model=model, prompt=f"p{i}", max_tokens=5, temperature=0) for i in range(8)))
        await aclient.close()
        return results

    results = asyncio.run(run())
    assert all(r.usage.completion_tokens <= 5 and r.choices[0].finish_reason for r in results)


def test_multiple_prompts_times_n_are_indexed_in_order(client, model):
    r = client.completions.create(model=model, prompt=["alpha", "beta gamma"], n=2, max_tokens=4, echo=True,
                                  temperature=0.7, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(r.choices, ["alpha", "alpha", "beta gamma", "beta gamma"])] == [True] * 4
    tok = requests.post(client.base_url.scheme + "://" + client.base_url.host + f":{client.base_url.port}/tokenize",
                        json={"prompt": "alpha"}, headers=auth()).json()
    assert r.usage.prompt_tokens >= tok["count"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_style_scoring_matches_transformers(server, model_dir, max_tokens):
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (7, 12)]
    body = {"model": None, "prompt": contexts, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    body.pop("model")
    r = requests.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for ids, choice in zip(contexts, r.json()["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        # lm-eval's greedy check: the top-1 entry at each position.
        for pos in range(1, len(ids)):
            top_token, top_value = max(lp["top_logprobs"][pos].items(), key=lambda kv: kv[1])
            assert top_value == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
        assert lp["text_offset"] == sorted(lp["text_offset"])


def test_tokenize_detokenize_both_shapes(server):
    vllm = requests.post(server.url + "/tokenize", json={"prompt": "hello world"}, headers=auth()).json()
    crane = requests.post(server.url + "/v1/tokenize", json={"text": "hello world"}, headers=auth()).json()
    assert vllm["tokens"] == crane["tokens"] and vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"]
    chat = requests.post(server.url + "/tokenize", headers=auth(),
                         json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert chat["count"] > vllm["count"]
    back = requests.post(server.url + "/v1/detokenize", json={"tokens": vllm["tokens"]}, headers=auth()).json()
    assert back["prompt"] == back["text"] == "hello world"


def test_auth_errors_and_open_health(server, model):
    assert requests.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_error_statuses(server, client, model):
    assert requests.get(server.url + "/v1/models/not-there", headers=auth()).status_code == 404
    assert requests.get(server.url + "/v1/models/" + model, headers=auth()).json()["id"] == model
    assert requests.get(server.url + "/no/such/route", headers=auth()).status_code == 404
    big = {"prompt": "x" * 300_000}
    assert requests.post(server.url + "/v1/completions", json=big, headers=auth()).status_code == 413
    r = requests.post(server.url + "/v1/completions", data=b"{nope", headers=auth())
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long_prompt = [5] * 2097
    r = requests.post(server.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 5}, headers=auth())
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"] and "2097" in r.json()["error"]["message"]
    # max_tokens is an upper bound: past the window it is clamped to what is left (SGLang, llama.cpp).
    r = requests.post(server.url + "/v1/completions", json={"prompt": [5] * 2040, "max_tokens": 10**9,
                                                            "ignore_eos": True}, headers=auth())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", suffix="y")
    spec = requests.get(server.url + "/openapi.json", headers=auth()).json()
    assert spec["openapi"].startswith("3.") and "/v1/chat/completions" in spec["paths"]
    assert "ChatCompletionRequest" in spec["components"]["schemas"]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_fields = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
                           "logprobs", "top_logprobs", "logit_bias", "seed", "stream", "echo", "min_p",
                           "presence_penalty", "stop_token_ids", "min_tokens", "stream_options", "bogus", "text",
                           "input_ids", "sampling_params", "rid", "tokens", "chat_template_kwargs"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/generate",
                              "/abort_request"]),
       body=st.dictionaries(_fields, _json_values, max_size=6))
def test_random_bodies_never_get_a_5xx(server, route, body):
    if "max_tokens" in body and isinstance(body["max_tokens"], int):
        body["max_tokens"] = max(-5, min(body["max_tokens"], 8))  # keep accepted requests short
    if isinstance(body.get("n"), int):
        body["n"] = max(-1, min(body["n"], 3))
    r = requests.post(server.url + route, data=json.dumps(body), headers=auth(), timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400 and r.headers.get("Content-Type", "").startswith("application/json"):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_text_parts_content_equals_string_content(server, client, model):
    # The test models' templates read text parts and concatenate them, as Qwen2.5-VL's does.
    as_string = [{"role": "user", "content": "one two"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": " two"}]}]
    tokens = [requests.post(server.url + "/tokenize", json={"messages": m}, headers=auth()).json()["tokens"]
              for m in (as_string, as_parts)]
    assert tokens[0] == tokens[1]
    r = client.chat.completions.create(model=model, messages=as_parts, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(tokens[0])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
