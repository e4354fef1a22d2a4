"""Structured output and tool calling through the real three processes: every constrained answer obeys
its constraint, unconstrained requests batched with them are unchanged, constrained requests resume
losslessly after preemption, and the `openai` SDK reads forced tool calls, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import openai
import pytest

from crane_mp.model_tokenizer import load_tokenizer
from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}}}
WORD = r"[a-z]{20,40}"
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one
    srv = Server(model_dir, "--kv-cache-dtype", "float32", log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


def workload() -> list[tuple[str, dict]]:
    """Greedy requests: constrained ones of each kind and route, and unconstrained ones."""
    topic = " ".join(["tell me about the weather today"] * 4)
    jobs = []
    for i in range(3):
        jobs.append(("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"{topic} person {i}"}], "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}))
        jobs.append(("/v1/completions", {"prompt": f"{topic} word {i}", "max_tokens": 60, "temperature": 0,
                                         "structured_outputs": {"regex": WORD}}))
    jobs.append(("/generate", {"text": f"{topic} sglang", "sampling_params": {
        "max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(PERSON)}}))
    jobs.append(("/v1/completions", {"prompt": f"{topic} choice", "max_tokens": 8, "temperature": 0,
                                     "guided_choice": ["alpha", "beta", "gamma"]}))
    for i in range(2):
        jobs.append(("/v1/completions", {"prompt": f"{topic} free {i}", "max_tokens": 40, "temperature": 0,
                                         "ignore_eos": True}))
    return jobs


def output_text(route: str, body: dict) -> str:
    if route == "/generate":
        return body["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if route == "/v1/chat/completions" else choice["text"]


async def run_all(url: str, jobs: list[tuple[str, dict]], in_order: Server | None = None) -> list[str]:
    """Every job's output text, the jobs sent at once; with `in_order`, each sent once that server's
    scheduler holds the one before, so the scheduler admits them in the list's order."""
    async with aiohttp.ClientSession() as session:
        async def one(route, body):
            async with session.post(url + route, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return output_text(route, await resp.json())

        tasks = []
        for count, (route, body) in enumerate(jobs, 1):
            tasks.append(asyncio.ensure_future(one(route, body)))
            if in_order is not None:
                await in_order.queued(count, tasks[-1])
        return await asyncio.gather(*tasks)


def check_constraints(jobs, outputs) -> None:
    for (route, body), text in zip(jobs, outputs):
        constraint = body.get("response_format") or body.get("structured_outputs") or body.get("guided_choice") \
            or body.get("sampling_params", {}).get("json_schema")
        if constraint is None:
            continue
        if "regex" in str(constraint):
            assert re.fullmatch(WORD, text), text
        elif isinstance(constraint, list):
            assert text in constraint
        else:
            jsonschema.validate(json.loads(text), PERSON)


def test_every_constraint_holds_and_free_requests_are_unchanged_in_a_mixed_batch(server):
    jobs = workload()
    together = asyncio.run(run_all(server.url, jobs))
    check_constraints(jobs, together)
    free = [i for i, (_, body) in enumerate(jobs) if body.get("ignore_eos")]
    alone = asyncio.run(run_all(server.url, [jobs[i] for i in free]))
    assert [together[i] for i in free] == alone


def test_constrained_requests_resume_losslessly_after_preemption(model_dir, server, tmp_path):
    jobs = workload()
    roomy = asyncio.run(run_all(server.url, jobs))
    tight = Server(model_dir, "--max-total-tokens", "192", "--max-concurrent", "8", "--kv-cache-dtype", "float32",
                   log_path=tmp_path / "log")
    try:
        # in the list's order: which requests share the 192 tokens first decides whether any is preempted
        squeezed = asyncio.run(tight.all_queued(run_all(tight.url, jobs, in_order=tight), len(jobs)))
        assert tight.stats()["num_preemptions"] > 0
    finally:
        assert tight.stop() == 0
    check_constraints(jobs, squeezed)
    assert squeezed == roomy


def test_json_that_would_outrun_max_tokens_is_closed_in_time_and_reports_length(model_dir, server):
    """A model that never closes its strings (every token holding a quote biased away) still returns
    valid JSON within max_tokens, whole and streamed, with finish_reason length; a budget too small
    for any document runs out as before."""
    tokenizer = load_tokenizer(str(model_dir))
    quotes = {str(i): -100 for i in range(len(tokenizer)) if '"' in tokenizer.decode([i])}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    schema = {"type": "object", "required": ["note", "tags"], "properties": {
        "note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
    ask = dict(model=model, messages=[{"role": "user", "content": "Describe the weather."}], logit_bias=quotes,
               response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": schema}})
    for max_tokens in (24, 60):
        whole = client.chat.completions.create(max_tokens=max_tokens, seed=max_tokens, **ask)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens <= max_tokens
        jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
        text, finish = "", None
        for chunk in client.chat.completions.create(max_tokens=max_tokens, seed=max_tokens, stream=True, **ask):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (text, finish) == (whole.choices[0].message.content, "length")
    short = client.chat.completions.create(max_tokens=4, **ask)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4


def test_openai_sdk_reads_forced_tool_calls_whole_and_streamed(server):
    check_forced_tool_calls(server.url, max_tokens=120)


def test_openai_sdk_reads_forced_qwen3_coder_xml_calls(model_dir, tmp_path):
    coder = Server(model_dir, "--tool-call-parser", "qwen3_coder", log_path=tmp_path / "log")
    try:
        # One call: greedy, this random model would chain calls to max_tokens (the XML allows it as JSON does).
        check_forced_tool_calls(coder.url, max_tokens=400, parallel=False)
    finally:
        assert coder.stop() == 0


def check_forced_tool_calls(url: str, max_tokens: int, parallel: bool = True) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]

    whole = client.chat.completions.create(model=model, messages=messages, tools=[ADD, WEATHER],
                                           tool_choice="required", max_tokens=max_tokens, temperature=0,
                                           parallel_tool_calls=parallel)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"add": ADD, "get_weather": WEATHER}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    named = client.chat.completions.create(model=model, messages=messages, tools=[ADD, WEATHER],
                                           max_tokens=max_tokens,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo",
                                                                                                  "Lima")

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=[ADD, WEATHER],
                                                tool_choice="required", max_tokens=max_tokens, temperature=0,
                                                parallel_tool_calls=parallel, stream=True):
        delta = chunk.choices[0].delta
        for item in delta.tool_calls or []:
            entry = calls.setdefault(item.index, {"name": None, "arguments": "", "pieces": 0})
            entry["name"] = item.function.name or entry["name"]
            entry["arguments"] += item.function.arguments or ""
            entry["pieces"] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert max(c["pieces"] for c in calls.values()) > 2  # arguments arrived in pieces

    history = messages + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in choice.message.tool_calls]
    follow_up = client.chat.completions.create(model=model, messages=history, tools=[ADD, WEATHER], max_tokens=5,
                                               tool_choice="none")
    assert follow_up.choices[0].message.tool_calls is None


def test_two_tensor_parallel_ranks_build_every_matcher_and_sample_alike(model_dir, server, tmp_path):
    """Rank 0 builds a matcher in the background and answers; the other rank builds it before its next
    step: every constraint holds and the outputs are one rank's, seeded samples included."""
    seeded = [("/v1/completions", {"prompt": f"sample {i}", "max_tokens": 24, "temperature": 0.9, "seed": i,
                                   "ignore_eos": True}) for i in range(3)]
    jobs = workload() + seeded
    one_rank = asyncio.run(run_all(server.url, jobs))
    two = Server(model_dir, "--tensor-parallel-size", "2", "--kv-cache-dtype", "float32", log_path=tmp_path / "log")
    try:
        two_ranks = asyncio.run(run_all(two.url, jobs))
    finally:
        assert two.stop() == 0
    check_constraints(jobs, two_ranks)
    assert two_ranks == one_rank
