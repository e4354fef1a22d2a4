"""The APIs agents speak, driven by the real SDKs through the three processes: the OpenAI Responses API
(`client.responses.create` / `.stream`, forced function calls, previous_response_id across the
server's two frontends, stored responses) and Anthropic Messages (`messages.create` / `.stream`,
forced tool use, count_tokens, x-api-key, Anthropic-shaped errors)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import requests
from transformers import AutoTokenizer

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

KEY = "agent-key"
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, "--api-key", KEY, "--num-frontends", "2",
                 log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_responses_whole_and_streamed(client, model):
    whole = client.responses.create(model=model, input="hello there", instructions="Answer briefly.",
                                    max_output_tokens=12, temperature=0)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == model
    assert whole.status in ("completed", "incomplete") and whole.instructions == "Answer briefly."
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0
    with client.responses.stream(model=model, input="hello there", instructions="Answer briefly.",
                                 max_output_tokens=12, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text  # greedy: the same answer


def test_responses_forced_function_calls_and_a_follow_up(client, model):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}]
    whole = client.responses.create(model=model, input="Weather in Paris for 3 days?", tools=tools,
                                    tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    with client.responses.stream(model=model, input="Weather in Oslo?", tools=tools, max_output_tokens=120,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        pieces = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == streamed.arguments and len(pieces) > 1
    jsonschema.validate(json.loads(streamed.arguments), WEATHER_PARAMETERS)
    follow_up = client.responses.create(model=model, previous_response_id=whole.id, tools=tools, max_output_tokens=6,
                                        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                "output": "sunny, 21 C"}], tool_choice="none")
    assert follow_up.previous_response_id == whole.id
    assert follow_up.usage.input_tokens > whole.usage.input_tokens  # the earlier turns are in the prompt
    assert not [item for item in follow_up.output if item.type == "function_call"]


def test_stored_responses_are_found_through_every_frontend(server, client, model):
    ids = [client.responses.create(model=model, input=f"note {i}", max_output_tokens=2).id for i in range(6)]
    headers = {"Authorization": f"Bearer {KEY}"}
    for response_id in ids * 3:  # a new connection each time: the kernel spreads them over both frontends
        got = requests.get(f"{server.url}/v1/responses/{response_id}", headers=headers, timeout=30)
        assert got.status_code == 200 and got.json()["id"] == response_id
    assert requests.delete(f"{server.url}/v1/responses/{ids[0]}", headers=headers, timeout=30).json()["deleted"]
    assert requests.get(f"{server.url}/v1/responses/{ids[0]}", headers=headers, timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=ids[0], max_output_tokens=2)


def test_anthropic_messages_whole_and_streamed(claude, model):
    turns = [{"role": "user", "content": "hello there"}]
    greedy = {"temperature": 0}  # the 2026 SDK sends sampling settings only as extra fields
    whole = claude.messages.create(model=model, max_tokens=12, system="Answer briefly.", messages=turns,
                                   extra_body=greedy)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == model
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
    with claude.messages.stream(model=model, max_tokens=12, system="Answer briefly.", messages=turns,
                                extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(block.text for block in final.content if block.type == "text")
    # greedy: the same blocks (the tiny Qwen3 thinks: a thinking block, and text after any </think>)
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in whole.content]
    counted = claude.messages.count_tokens(model=model, system="Answer briefly.", messages=turns)
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_anthropic_forced_tool_use_whole_and_streamed(claude, model):
    tools = [{"name": "get_weather", "description": "Weather by city", "input_schema": WEATHER_PARAMETERS}]
    turns = [{"role": "user", "content": "Weather in Lima for 2 days?"}]
    whole = claude.messages.create(model=model, max_tokens=120, messages=turns, tools=tools,
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0})
    uses = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and uses
    for use in uses:
        jsonschema.validate(use.input, WEATHER_PARAMETERS)
    with claude.messages.stream(model=model, max_tokens=120, messages=turns, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    [use] = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER_PARAMETERS)
    history = turns + [{"role": "assistant", "content": [block.model_dump() for block in whole.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                     "content": "sunny"}]}]
    after = claude.messages.create(model=model, max_tokens=5, messages=history, tools=tools,
                                   tool_choice={"type": "none"})
    assert not [block for block in after.content if block.type == "tool_use"]


def test_anthropic_structured_output(claude, model):
    reply = claude.messages.create(model=model, max_tokens=120, messages=[{"role": "user", "content": "Weather?"}],
                                   output_config={"format": {"type": "json_schema", "schema": WEATHER_PARAMETERS}})
    [block] = reply.content
    jsonschema.validate(json.loads(block.text), WEATHER_PARAMETERS)


def test_anthropic_errors_and_keys(server, model):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0).messages.create(
            model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    image = requests.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, timeout=30, json={
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]})
    assert image.status_code == 400 and image.json()["error"]["type"] == "invalid_request_error"


SHORT_CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}


def _streamed_chat_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str, str | None]:
    """(name, arguments) of each streamed call, the content, the finish: as a client accumulates them."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for item in delta.tool_calls or []:
            call = calls.setdefault(item.index, ["", ""])
            call[0] += item.function.name or ""
            call[1] += item.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(call) for call in calls.values()], content, finish


def test_forced_calls_that_max_tokens_cuts_keep_their_whole_calls(client, model, model_dir):
    """Issue 47: with tool_choice required and short strings, a model that would call on and on (its EOS
    disfavoured) starts a second call that max_tokens would cut: the grammar ends after the last call
    that fits, and the answer, whole and streamed, holds whole calls only with finish_reason length (a cut
    call used to leave the answer as raw <tool_call> text). Responses' forced calls are as whole."""
    eos = AutoTokenizer.from_pretrained(str(model_dir)).convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SHORT_CITY}}]
    for max_tokens in range(60, 130, 10):
        kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=chat_tools,
                      tool_choice="required", max_tokens=max_tokens, temperature=1.0, seed=3,
                      logit_bias={str(token): -100 for token in eos})
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls and not choice.message.content, choice
        whole = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
        for _, arguments in whole:
            jsonschema.validate(json.loads(arguments), SHORT_CITY)
        assert _streamed_chat_calls(client, **kwargs) == (whole, "", "length")  # the same seed, the same calls

    tools = [{"type": "function", "name": "get_weather", "parameters": SHORT_CITY}]
    for max_tokens in (50, 60, 90):
        ask = dict(model=model, input="Weather?", tools=tools, tool_choice="required", max_output_tokens=max_tokens,
                   temperature=0)
        response = client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            final = stream.get_final_response()
        calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
        assert calls and [item.type for item in response.output] == ["function_call"] * len(calls), response.output
        assert [(item.name, item.arguments) for item in final.output] == calls and final.status == response.status
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), SHORT_CITY)
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
