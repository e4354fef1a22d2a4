"""Reasoning apart from the answer (frontend/serving/reasoning.py): in thinking mode an answer is reasoning until
its first </think>, opened or not (all of it when none comes); a prompt that closed the think block
(enable_thinking false) leaves it all content; the split is lossless and the same in every chunking;
chat completions, Responses and Messages carry the parts apart, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from anthropic.types import Message
from openai.types.responses import Response
from tokenizers import AddedToken, Tokenizer

from crane_mp.frontend.serving.reasoning import (
    END,
    GEMMA4_THINK,
    LEADING,
    PLAIN,
    SEED_THINK,
    START,
    THINK,
    THINKING,
    ReasoningSplitter,
    reading_mode,
    reasoning_markers,
    split_reasoning,
    template_thinks,
)
from crane_mp.protocol import FinishReason, ThinkingBudget, TokenOutput
from crane_mp.testing.make_zoo import make_zoo_model
from tests.unit.frontend_harness import start_frontend, stop_frontend

ASKED = "<|im_start|>assistant\n"  # Qwen3's generation prompt: it thinks unless told not to
OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the same with enable_thinking false
OPENED = "<|im_start|>assistant\n<think>\n"  # R1's, and Qwen3's thinking releases'
CASES = [  # (prompt, the template thinks, answer, reasoning, content)
    (ASKED, True, "<think>\nweigh it</think>\n\nIt is 4.", "\nweigh it", "\n\nIt is 4."),
    (ASKED, True, "weigh it</think>It is 4.", "weigh it", "It is 4."),  # no opening tag: still thinking
    (ASKED, True, "weigh it, cut off", "weigh it, cut off", ""),  # no tag at all: all thinking (vLLM's qwen3)
    (ASKED, True, "<thin>not a tag</think>", "<thin>not a tag", ""),
    (ASKED, True, "", "", ""),
    (OFF, True, "It is 4.", None, "It is 4."),
    (OFF, True, "<think>a</think>b", None, "<think>a</think>b"),  # thinking off: all content
    (OPENED, True, "weigh it\n</think>It is 4.", "weigh it\n", "It is 4."),
    (OPENED, True, "weigh it, cut off", "weigh it, cut off", ""),
    (OPENED, True, "<think>a</think>b", "a", "b"),  # R1-0528 writes the tag its template opened
    ("x<think>a</think>y" + ASKED, True, "<think></think>answer", "", "answer"),  # an earlier turn's block
    (ASKED, False, "It is 4.", None, "It is 4."),  # a template that never thinks (Qwen3 instruct releases)
    (ASKED, False, "<think>t</think>a", "t", "a"),
    (ASKED, False, "a</think>b", None, "a</think>b"),
]


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _tagged(text: str | None, markers) -> str | None:
    """A case's text with Seed-OSS's tags where it has Qwen3's."""
    if text is None:
        return None
    return text.replace(END, "\0").replace(START, markers.start).replace("\0", markers.end)


@pytest.mark.parametrize("markers", [THINK, SEED_THINK], ids=["think", "seed_think"])
@pytest.mark.parametrize("case", CASES)
def test_the_split_is_lossless_and_the_same_in_every_chunking(case, markers):
    prompt, answer, reasoning, content = (_tagged(text, markers) for text in (case[0], *case[2:]))
    thinks = case[1]
    mode = reading_mode(prompt, False, thinks, markers)
    assert split_reasoning(mode, answer, markers) == (reasoning, content)
    dropped = reasoning is not None and answer.startswith(markers.start)  # the opening tag the answer wrote
    ended = reasoning is not None and markers.end in answer
    assert (markers.start if dropped else "") + (reasoning or "") + (markers.end if ended else "") + content == answer
    for seed in range(20):
        splitter = ReasoningSplitter.reading(mode, markers)
        fed = [splitter.feed(piece) for piece in _pieces(answer, seed)] + [splitter.finish()]
        assert "".join(r for r, _ in fed) == (reasoning or "")
        assert "".join(c for _, c in fed) == content
        assert splitter.thought == (reasoning is not None)


def test_how_a_prompt_s_answer_is_read():
    assert reading_mode(ASKED, False, True) == THINKING and reading_mode(OPENED, False, False) == THINKING
    assert reading_mode(OFF, False, True) == PLAIN and reading_mode(ASKED, False, False) == LEADING
    assert reading_mode(ASKED + "The answer is", True, True) == PLAIN  # continuing the final message's text
    assert reading_mode(OPENED + "so far", True, True) == THINKING  # ... or its open thinking
    assert template_thinks("auto", frozenset({"messages", "enable_thinking"}))
    assert not template_thinks("auto", frozenset({"messages"})) and template_thinks("auto", None)
    assert template_thinks("qwen3", frozenset()) and template_thinks("deepseek_r1", frozenset())


def test_auto_reads_thinking_where_the_vocabulary_has_both_tags():
    assert reasoning_markers("auto", {START: 1, END: 2}) == THINK
    assert reasoning_markers("auto", {START: 1}) is None
    assert reasoning_markers("auto", {"<seed:think>": 5, "</seed:think>": 6}) == SEED_THINK  # Seed-OSS
    assert reasoning_markers("deepseek_r1", {}) == THINK and reasoning_markers("seed_oss", {}) == SEED_THINK
    assert reasoning_markers("none", {START: 1, END: 2}) is None
    # Qwen3's tags are not Seed-OSS's: its answer's <think> is content.
    assert split_reasoning(LEADING, "<think>a</think>b", SEED_THINK) == (None, "<think>a</think>b")


GEMMA4_PROMPT = "<|turn>user\nhi<turn|>\n<|turn>model\n"


@pytest.mark.parametrize(("answer", "reasoning", "content"), [
    ("<|channel>thought\nweigh it<channel|>It is 4.", "weigh it", "It is 4."),
    ("<|channel>thought\nweigh it, cut off", "weigh it, cut off", ""),
    ("It is 4.", None, "It is 4."),  # no thinking asked for (enable_thinking false): the answer alone
    ("It is 4.<channel|>", None, "It is 4.<channel|>"),
])
def test_gemma4_thinks_only_in_a_channel_it_opens_itself(answer, reasoning, content):
    """Gemma 4's template takes enable_thinking, yet the answer is read for a block it opens itself
    (Qwen3's rule would make an answer that never thinks all reasoning); the label `thought\n` is the
    block's own, not the reasoning's."""
    mode = reading_mode(GEMMA4_PROMPT, False, template_thinks("auto", frozenset({"enable_thinking"})), GEMMA4_THINK)
    assert mode == LEADING
    assert split_reasoning(mode, answer, GEMMA4_THINK) == (reasoning, content)
    for seed in range(10):
        splitter = ReasoningSplitter.reading(mode, GEMMA4_THINK)
        fed = [splitter.feed(piece) for piece in _pieces(answer, seed)] + [splitter.finish()]
        assert ("".join(r for r, _ in fed), "".join(c for _, c in fed)) == (reasoning or "", content)
    assert reasoning_markers("auto", {"<|channel>": 100, "<channel|>": 101}) == GEMMA4_THINK
    assert reasoning_markers("gemma4", {}) == GEMMA4_THINK


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
        # Thinking mode: the sampler counts the thinking from the first token, as the answer is read.
        assert budget == ThinkingBudget(7, state.think_start_token, state.think_end_token, True)
    body = {"messages": [{"role": "user", "content": "q"}], "thinking_budget": 7, "separate_reasoning": False}
    await client.post("/v1/chat/completions", json=body)
    assert fake.requests[-1].sampling.thinking is None  # no reading for thinking: no budget either
    body = {"messages": [{"role": "user", "content": "q"}], "thinking_budget": 7,
            "chat_template_kwargs": {"enable_thinking": False}}
    await client.post("/v1/chat/completions", json=body)
    assert fake.requests[-1].sampling.thinking is None  # no thinking at all


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
    Response.model_validate(response)  # every field the SDK requires, of the right types
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == "\nsome thought"
    assert response["output"][1]["content"][0]["text"] == "\n\nThe answer."
    thought = fake.output_ids.index(state.think_end_token) + 1
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thought
    message = await (await client.post("/v1/messages", json={
        "model": state.model_name, "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]})).json()
    Message.model_validate(message)
    assert message["content"] == [{"type": "thinking", "thinking": "\nsome thought", "signature": ""},
                                  {"type": "text", "text": "\n\nThe answer."}]
    assert message["stop_reason"] == "end_turn"


async def _streamed(client, state, fake, path: str, body: dict, ids: list[int]) -> list[dict]:
    """The data payloads of `path` streamed, the fake scheduler answering `ids` one token a delta."""
    fake.answer = False
    seen = len(fake.requests)
    async with client.post(path, json={**body, "stream": True}) as r:
        while len(fake.requests) == seen:
            await asyncio.sleep(0)
        rid = fake.requests[-1].rid
        for i, token in enumerate(ids):
            state.client.streams[rid].push(TokenOutput(rid, [token], 3, i + 1,
                                                       FinishReason.STOP if i == len(ids) - 1 else None))
        text = await r.text()
    fake.answer = True
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


THINK_SHAPES = [  # (answer, chat_template_kwargs, reasoning_content, content)
    ("<think>a</think>b", None, "a", "b"),
    ("a</think>b", None, "a", "b"),  # the answer did not open its thinking: still reasoning until </think>
    ("a b", None, "a b", None),  # no </think>: all thinking, as vLLM's qwen3 parser reads it
    ("a</think>b", {"enable_thinking": False}, None, "a</think>b"),  # thinking off: all content
]


@pytest.mark.parametrize("answer, kwargs, reasoning, content", THINK_SHAPES)
async def test_chat_answers_split_alike_whole_and_streamed(frontend, answer, kwargs, reasoning, content):
    client, state, fake = frontend
    body = {"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": kwargs}
    fake.output_ids = ids = _ids(state, answer)
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    events = await _streamed(client, state, fake, "/v1/chat/completions", body, ids)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert not (reasoning is None and any("reasoning_content" in d for d in deltas))


async def test_responses_and_messages_read_an_unopened_thinking_alike_whole_and_streamed(frontend):
    client, state, fake = frontend
    fake.output_ids = ids = _ids(state, "a</think>b")
    response = await (await client.post("/v1/responses", json={"input": "q"})).json()
    assert [(item["type"], item["content"][0]["text"]) for item in response["output"]] == [
        ("reasoning", "a"), ("message", "b")]
    events = await _streamed(client, state, fake, "/v1/responses", {"input": "q"}, ids)
    assert [(item["type"], item["content"][0]["text"]) for item in events[-1]["response"]["output"]] == [
        ("reasoning", "a"), ("message", "b")]
    body = {"model": state.model_name, "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}
    message = await (await client.post("/v1/messages", json=body)).json()
    assert message["content"] == [{"type": "thinking", "thinking": "a", "signature": ""}, {"type": "text", "text": "b"}]
    events = await _streamed(client, state, fake, "/v1/messages", body, ids)
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert ("".join(d.get("thinking", "") for d in deltas), "".join(d.get("text", "") for d in deltas)) == ("a", "b")


async def test_seed_oss_thinks_in_its_own_tags_and_auto_reads_them(tmp_path):
    """A vocabulary holding Seed-OSS's tags (and not Qwen3's): chat answers split at </seed:think>, and
    its end token counts the thinking."""
    model_dir = make_zoo_model("seed_oss", tmp_path / "seed")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # Added but not special, as Seed-OSS's tokenizer has them: they stay in the decoded text.
    tokenizer.add_tokens([AddedToken(SEED_THINK.start, normalized=False), AddedToken(SEED_THINK.end, normalized=False)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    client, state, fake = await start_frontend(model_dir, tmp_path)
    try:
        assert state.reasoning and state.think_markers == SEED_THINK and state.think_end_token is not None
        fake.output_ids = _ids(state, "<seed:think>weigh it</seed:think>The answer.")
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
        body = await r.json()
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("weigh it", "The answer.")
        thought = fake.output_ids.index(state.think_end_token) + 1
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    finally:
        await stop_frontend(client, state)
