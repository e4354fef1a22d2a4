"""gpt-oss's chat answers through the frontend: its harmony channels, whose tags are special tokens of
its vocabulary, come back apart (reasoning_content, content, tool_calls) whole and streamed, and a
request's reasoning_effort reaches the chat template."""

from __future__ import annotations

import json

import pytest

from crane_mp.testing.make_zoo import make_zoo_model
from tests.unit.frontend_harness import add_special_tokens, start_frontend, stop_frontend, token_ids

TAGS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# The released template's shape, cut down: a system message stating the effort, then the turns.
TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
            "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
CALL = ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"


@pytest.fixture
async def gpt_oss(tmp_path):
    model_dir = make_zoo_model("gpt_oss", tmp_path / "gpt_oss")
    add_special_tokens(model_dir, TAGS)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    client, state, fake = await start_frontend(model_dir, tmp_path, tool_call_parser="auto", reasoning_parser="auto")
    try:
        yield client, state, fake
    finally:
        await stop_frontend(client, state)


async def test_a_tool_call_and_the_thinking_come_back_apart_whole(gpt_oss):
    client, state, fake = gpt_oss
    fake.output_ids = token_ids(state, CALL)
    body = await (await client.post("/v1/chat/completions", json=ASK)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "Look it up." and not message["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]


async def test_the_final_channel_streams_as_content(gpt_oss):
    client, state, fake = gpt_oss
    fake.output_ids = token_ids(state, FINAL)
    r = await client.post("/v1/chat/completions", json={**ASK, "stream": True})
    reasoning, content, calls = "", "", []
    for line in (await r.text()).splitlines():
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
    assert (reasoning, content, calls) == ("Easy.", "Sunny.", [])


async def test_reasoning_effort_reaches_the_template(gpt_oss):
    client, state, fake = gpt_oss
    body = {"messages": ASK["messages"], "reasoning_effort": "high"}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    assert "Reasoning: high" in state.tokenizer.tokenizer.decode(fake.requests[-1].input_ids)


async def test_a_forced_call_goes_to_the_engine_with_harmony_s_grammar(gpt_oss):
    """tool_choice naming a function: the grammar writes its commentary message, the tags as their
    tokens, and the answer reads back as that call."""
    client, state, fake = gpt_oss
    fake.output_ids = token_ids(state, CALL.split("<|start|>assistant")[1])
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = await (await client.post("/v1/chat/completions", json={**ASK, "tool_choice": named})).json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    grammar = fake.requests[-1].sampling.grammar
    vocab = state.tokenizer.added_vocab
    assert grammar is not None and "commentary to=functions.get_weather" in grammar
    assert all(f"<[{vocab[tag]}]>" in grammar for tag in ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"))
