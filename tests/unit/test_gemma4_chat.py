"""Gemma 4's chat answers through the frontend: its thinking channel and tool calls, whose marks are
special tokens of its vocabulary, come back apart (reasoning_content, tool_calls) whole and streamed,
while its other special tokens still leave the text; a forced call goes to the engine with its grammar."""

from __future__ import annotations

import json

import pytest

from crane_mp.protocol import ThinkingBudget
from crane_mp.testing.make_zoo import make_zoo_model
from tests.unit.frontend_harness import add_special_tokens, start_frontend, stop_frontend, token_ids

MARKS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<turn|>"]
ANSWER = '<|channel>thought\nweigh it<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ASK = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}


@pytest.fixture
async def gemma4(tmp_path):
    model_dir = make_zoo_model("gemma4_text", tmp_path / "gemma4")
    add_special_tokens(model_dir, MARKS)
    client, state, fake = await start_frontend(model_dir, tmp_path, tool_call_parser="auto", reasoning_parser="auto")
    try:
        yield client, state, fake
    finally:
        await stop_frontend(client, state)


async def test_thinking_and_calls_come_back_apart_whole(gemma4):
    client, state, fake = gemma4
    fake.output_ids = token_ids(state, ANSWER + "<turn|>")
    body = await (await client.post("/v1/chat/completions", json=ASK)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "weigh it" and not message["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 2})]


async def test_thinking_and_calls_come_back_apart_streamed(gemma4):
    client, state, fake = gemma4
    fake.output_ids = token_ids(state, ANSWER)
    r = await client.post("/v1/chat/completions", json={**ASK, "stream": True})
    reasoning, content, arguments, names = "", "", "", []
    for line in (await r.text()).splitlines():
        if not line.startswith("data: {"):
            continue
        delta = json.loads(line[6:])["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            names += [call["function"]["name"]] if "name" in call["function"] else []
            arguments += call["function"].get("arguments", "")
    assert (reasoning, content, names) == ("weigh it", "", ["get_weather"])
    assert json.loads(arguments) == {"city": "Paris", "days": 2}


async def test_a_thinking_budget_counts_from_the_channel_the_answer_opens(gemma4):
    client, state, fake = gemma4
    body = {"messages": ASK["messages"], "thinking_budget": 7}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    vocab = state.tokenizer.added_vocab
    assert fake.requests[-1].sampling.thinking == ThinkingBudget(7, vocab["<|channel>"], vocab["<channel|>"], False)


async def test_without_tools_the_marks_leave_the_text_and_a_forced_call_carries_its_grammar(gemma4):
    client, state, fake = gemma4
    fake.output_ids = token_ids(state, 'A <|"|>quoted<|"|> word.<turn|>')
    body = await (await client.post("/v1/chat/completions", json={"messages": ASK["messages"]})).json()
    assert body["choices"][0]["message"]["content"] == "A quoted word."
    fake.output_ids = token_ids(state, ANSWER.split("<channel|>")[1])
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = await (await client.post("/v1/chat/completions", json={**ASK, "tool_choice": named})).json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    grammar = fake.requests[-1].sampling.grammar
    assert grammar is not None and "call:get_weather" in grammar
