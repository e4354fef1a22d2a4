"""Reasoning apart from the answer (frontend/reasoning.py): the split is lossless in every chunking,
a prompt that opens <think> (DeepSeek-R1's template) makes the answer start thinking, and chat
completions carry reasoning_content, content and reasoning_tokens, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from crane_mp.frontend.reasoning import (END, START, ReasoningSplitter, prompt_opens_thinking, reasoning_enabled,
                                         split_reasoning)
from crane_mp.protocol import FinishReason, ThinkingBudget, TokenOutput

CASES = [  # (prompt, answer, reasoning, content)
    ("<|im_start|>assistant\n", "<think>\nweigh it</think>\n\nIt is 4.", "\nweigh it", "\n\nIt is 4."),
    ("<|im_start|>assistant\n", "It is 4.", None, "It is 4."),  # thinking off: no tag
    ("<|im_start|>assistant\n<think>\n", "weigh it\n</think>It is 4.", "weigh it\n", "It is 4."),  # R1
    ("<|im_start|>assistant\n<think>\n", "weigh it, cut off", "weigh it, cut off", ""),
    ("<|im_start|>assistant\n", "<think>still thinking", "still thinking", ""),
    ("<|im_start|>assistant\n", "<thin>not a tag</think>", None, "<thin>not a tag</think>"),
    ("x<think>a</think>y", "<think></think>answer", "", "answer"),
]


@pytest.mark.parametrize("prompt, answer, reasoning, content", CASES)
def test_the_split_is_lossless_in_every_chunking(prompt, answer, reasoning, content):
    assert split_reasoning(prompt_opens_thinking(prompt), answer) == (reasoning, content)
    opened = answer.startswith(START) and prompt.rfind(START) <= prompt.rfind(END)
    rebuilt = (START if opened else "") + (reasoning or "") + (END if END in answer and reasoning is not None
                                                              else "") + content
    assert rebuilt == answer
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(1, 8))))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        splitter = ReasoningSplitter.opening(prompt_opens_thinking(prompt))
        fed = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in fed) == (reasoning or "")
        assert "".join(c for _, c in fed) == content


def test_auto_reads_thinking_where_the_vocabulary_has_both_tags():
    assert reasoning_enabled("auto", {START: 1, END: 2})
    assert not reasoning_enabled("auto", {START: 1})
    assert reasoning_enabled("deepseek_r1", {}) and not reasoning_enabled("none", {START: 1, END: 2})


def _ids(state, text: str) -> list[int]:
    return state.tokenizer.tokenizer.encode(text, add_special_tokens=False)


async def test_chat_answers_carry_reasoning_apart_and_count_its_tokens(frontend):
    client, state, fake = frontend
    assert state.reasoning and state.think_end_token is not None  # the tiny vocabulary has both tags
    fake.output_ids = _ids(state, "<think>\nsome thought</think>\n\nThe answer.")
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    body = await r.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "\nsome thought"
    assert message["content"] == "\n\nThe answer."
    thought = fake.output_ids.index(state.think_end_token) + 1
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}


async def test_streamed_reasoning_adds_up_to_the_whole_answer_and_is_counted(frontend):
    client, state, fake = frontend
    fake.answer = False
    ids = _ids(state, "<think>\nsome thought</think>\n\nThe answer.")
    body = {"messages": [{"role": "user", "content": "q"}], "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.post("/v1/chat/completions", json=body) as r:
        while not fake.requests:
            await asyncio.sleep(0)
        stream = state.client.streams[fake.requests[0].rid]
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            stream.push(TokenOutput(fake.requests[0].rid, [token], 3, i + 1, FinishReason.STOP if last else None))
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nsome thought"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nThe answer."
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == ids.index(state.think_end_token) + 1


@pytest.mark.parametrize("server_args, request_fields", [({"reasoning_parser": "none"}, {}),
                                                          ({}, {"separate_reasoning": False})])
async def test_an_answer_is_left_whole_where_asked(frontend, request_fields):
    client, state, fake = frontend
    fake.output_ids = _ids(state, "<think>t</think>a")
    body = {"messages": [{"role": "user", "content": "q"}], **request_fields}
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert message["content"] == "<think>t</think>a" and "reasoning_content" not in message


async def test_a_thinking_budget_reaches_the_sampler_with_the_think_tokens(frontend):
    client, state, fake = frontend
    for field in ("thinking_budget", "max_thinking_tokens"):
        body = {"messages": [{"role": "user", "content": "q"}], field: 7}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        budget = fake.requests[-1].sampling.thinking
        assert budget == ThinkingBudget(7, state.think_start_token, state.think_end_token, False)
    body = {"messages": [{"role": "user", "content": "q"}], "thinking_budget": 7, "separate_reasoning": False}
    await client.post("/v1/chat/completions", json=body)
    assert fake.requests[-1].sampling.thinking is None  # no reading for thinking: no budget either


async def test_a_constrained_answer_thinks_first_only_where_the_prompt_opened_thinking(frontend):
    client, state, fake = frontend
    fake.output_ids = _ids(state, 'plan</think>{"a": 1}')
    opened = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\n"}]
    body = {"messages": opened, "continue_final_message": True, "add_generation_prompt": False,
            "response_format": {"type": "json_object"}, "max_tokens": 100}
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert message["reasoning_content"] == "plan" and json.loads(message["content"]) == {"a": 1}
    # The grammar waits for </think>; thinking gets half the room unless the request says otherwise.
    assert fake.requests[-1].sampling.thinking == ThinkingBudget(
        50, state.think_start_token, state.think_end_token, True)

    body = {"messages": [{"role": "user", "content": "q"}], "response_format": {"type": "json_object"}}
    fake.output_ids = _ids(state, '{"a": 1}')
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert json.loads(message["content"]) == {"a": 1}
    assert fake.requests[-1].sampling.thinking is None  # constrained from the first token: no thinking


async def test_sglang_generate_and_separate_reasoning_split_the_thinking(frontend):
    client, state, fake = frontend
    fake.output_ids = _ids(state, "<think>\nsome thought</think>\n\nThe answer.")
    body = await (await client.post("/generate", json={"text": "q", "separate_reasoning": True})).json()
    assert (body["reasoning_text"], body["text"]) == ("\nsome thought", "\n\nThe answer.")
    raw = await (await client.post("/generate", json={"text": "q"})).json()
    assert raw["text"] == "<think>\nsome thought</think>\n\nThe answer." and "reasoning_text" not in raw
    for parser, text, expected in [("qwen3", "<think>a</think>b", ("a", "b")), ("qwen3", "plain", ("", "plain")),
                                   ("deepseek-r1", "a</think>b", ("a", "b")),
                                   ("deepseek-r1", "<think>a</think>b", ("a", "b"))]:
        split = await (await client.post("/separate_reasoning", json={"text": text, "reasoning_parser": parser})).json()
        assert (split["reasoning_text"], split["text"]) == expected, (parser, text)


async def test_responses_and_messages_carry_the_thinking_apart(frontend):
    client, state, fake = frontend
    fake.output_ids = _ids(state, "<think>\nsome thought</think>\n\nThe answer.")
    response = await (await client.post("/v1/responses", json={"input": "q"})).json()
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == "\nsome thought"
    assert response["output"][1]["content"][0]["text"] == "\n\nThe answer."
    thought = fake.output_ids.index(state.think_end_token) + 1
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thought
    message = await (await client.post("/v1/messages", json={
        "model": state.model_name, "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]})).json()
    assert message["content"] == [{"type": "thinking", "thinking": "\nsome thought", "signature": ""},
                                  {"type": "text", "text": "\n\nThe answer."}]
    assert message["stop_reason"] == "end_turn"
