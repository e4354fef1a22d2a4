"""Structured output and tool calling through the real routes over the fake scheduler: which grammar
reaches the engine for each spelling of a constraint, the 400s that name what is wrong, and tool
calls read out of the engine's tokens, whole and streamed."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from crane_mp.frontend.serving.structured import Constraint, to_grammar
from crane_mp.testing.make_model import make_model
from tests.unit.frontend_harness import start_frontend, stop_frontend

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
ADD = {"type": "function", "function": {"name": "add", "description": "sum", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture
async def frontend(model_dir, tmp_path):
    client, state, fake = await start_frontend(model_dir, tmp_path, 1024)
    yield client, state, fake
    await stop_frontend(client, state)


def json_grammar(schema) -> str:
    return to_grammar(Constraint.json_schema(schema, "x"))


@pytest.mark.parametrize("route,body,expected", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": SCHEMA}}},
     json_grammar(SCHEMA)),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, json_grammar({"type": "object"})),
    ("/v1/completions", {"prompt": "hi", "guided_json": json.dumps(SCHEMA)}, json_grammar(SCHEMA)),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "[ab]+"}},
     LLMatcher.grammar_from_regex("[ab]+")),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]},
     LLMatcher.grammar_from_lark('start: "yes" | "no"')),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, None),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA)}}, json_grammar(SCHEMA)),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "[0-9]{3}"}}, LLMatcher.grammar_from_regex("[0-9]{3}")),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "text"}}, "unconstrained"),
])
async def test_each_spelling_of_a_constraint_reaches_the_engine_as_its_grammar(frontend, route, body, expected):
    client, state, fake = frontend
    r = await client.post(route, json=body)
    assert r.status == 200, await r.text()
    grammar = fake.requests[-1].sampling.grammar
    if expected == "unconstrained":
        assert grammar is None
    elif expected is None:  # a GBNF grammar: converted to Lark
        assert grammar is not None and 'start: "a"' in grammar
    else:
        assert grammar == expected


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "wat"}}, "guided_json", "wat"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice", "at least one"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not several"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar",
     "grammar"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.ebnf",
     "not several"),
    ("/v1/chat/completions", {**CHAT, "tools": [ADD], "tool_choice": "required", "guided_regex": "a"},
     "guided_regex", "tool_choice required"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among"),
])
async def test_a_bad_constraint_is_a_400_that_names_it(frontend, route, body, param, words):
    client, state, fake = frontend
    r = await client.post(route, json=body)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["param"] == param and words in error["message"], error
    assert fake.requests == [] and state.client.streams == {}


async def test_the_same_schema_is_compiled_once(frontend, monkeypatch):
    client, state, fake = frontend
    calls = []
    original = state.grammars._validated
    monkeypatch.setattr(state.grammars, "_validated", lambda c: calls.append(c) or original(c))
    for _ in range(3):
        r = await client.post("/v1/completions", json={"prompt": "hi", "guided_json": SCHEMA})
        assert r.status == 200
    assert len(calls) == 1


async def test_tools_reach_the_template_and_a_named_function_is_forced(frontend):
    client, state, fake = frontend
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    fake.output_ids = state.tokenizer.tokenizer.encode(call_text, add_special_tokens=False)
    body = {**CHAT, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and call["type"] == "function"

    sent = fake.requests[-1]
    prompt = state.tokenizer.decode(sent.input_ids, skip_special_tokens=False)
    assert '"name": "add"' in prompt and "<tools>" in prompt  # the template listed the tool
    grammar = sent.sampling.grammar
    assert grammar.startswith("start: call\n") and '"name": {"const": "add"}' in grammar  # one call of add


async def test_auto_tool_calls_stream_as_deltas_and_history_with_calls_renders(frontend):
    client, state, fake = frontend
    # A thinking model's answer (the template thinks): the thinking, then content and the call.
    text = '<think>sum</think>Checking.<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 20}}\n</tool_call>'
    fake.output_ids = state.tokenizer.tokenizer.encode(text, add_special_tokens=False)
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": [ADD], "stream": True})
    assert r.status == 200
    chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    items = [item for d in deltas for item in d.get("tool_calls", [])]
    assert content == "Checking."
    assert items[0]["function"]["name"] == "add" and items[0]["id"].startswith("call_")
    assert json.loads("".join(i["function"]["arguments"] for i in items)) == {"a": 10, "b": 20}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert fake.requests[-1].sampling.grammar is None  # auto: the model decides, nothing is forced

    history = [{"role": "user", "content": "add"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": items[0]["id"], "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 10, "b": 20}'}}]},
               {"role": "tool", "tool_call_id": items[0]["id"], "content": "30"}]
    fake.output_ids = None
    r = await client.post("/v1/chat/completions", json={"messages": history, "tools": [ADD], "max_tokens": 2})
    assert r.status == 200
    prompt = state.tokenizer.decode(fake.requests[-1].input_ids, skip_special_tokens=False)
    assert '{"name": "add", "arguments": {"a": 10, "b": 20}}' in prompt and "<tool_response>\n30\n" in prompt


async def test_without_tools_in_the_template_they_go_into_the_system_message(frontend):
    client, state, fake = frontend
    state.tokenizer.template_variables = state.tokenizer.template_variables - {"tools"}
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": [ADD]})
    assert r.status == 200
    prompt = state.tokenizer.decode(fake.requests[-1].input_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou can call these functions") and '"name": "add"' in prompt
