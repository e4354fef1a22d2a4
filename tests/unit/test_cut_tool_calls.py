"""Tool calls cut by max_tokens (issue 47): the answer keeps every call it finished, as calls, and drops
the one the cut left open, with finish_reason length (chat) or status incomplete (Responses), whole
and streamed, in every chunking; an answer that finished no call stays plain content."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from crane_mp.frontend.anthropic.answers import content_blocks, stop_reason
from crane_mp.frontend.openai.bodies import ChatStream, chat_choice
from crane_mp.frontend.responses.answers import ResponseDraft, ResponsesStream, output_items, usage
from crane_mp.frontend.serving.answers import ToolReading, read_whole
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.tools.formats import FORMATS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CUTS = [  # a whole call, then a second one max_tokens cut: in its arguments, its name, its marker
    CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
    CALL + '\n<tool_call>\n{"name": "get_wea',
    CALL + "\n<tool_",
]
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
XML_CUT = XML_CALL + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"
HERMES = ToolReading(FORMATS["hermes"])
KEPT = [("get_weather", {"city": "Paris"})]
BASE = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}


@dataclass
class Gen:
    prompt_tokens: int = 12
    cached_tokens: int = 0
    completion_tokens: int = 40


def pieces(text: str, seed: int, finish: str = "length") -> list[Delta]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [Delta(part, [1], finish_reason=finish if i == len(parts) - 1 else None) for i, part in enumerate(parts)]


def named(calls: list[dict] | None) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls or []]


@pytest.mark.parametrize("text, reading", [*((cut, HERMES) for cut in CUTS),
                                           (XML_CUT, ToolReading(FORMATS["qwen3_coder"]))])
def test_a_cut_answer_keeps_its_whole_calls(text, reading):
    answer = read_whole(text, [], reading, None, "length")
    assert answer.content is None and named(answer.calls) == KEPT


@pytest.mark.parametrize("text", [CUTS[0], CUTS[1]])
def test_a_call_left_open_by_the_model_itself_leaves_the_answer_content(text):
    assert read_whole(text, [], HERMES, None, "stop").calls is None  # malformed, not cut: as before


def test_an_answer_cut_in_its_first_call_stays_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    answer = read_whole(text, [], HERMES, None, "length")
    assert (answer.content, answer.calls) == (text, None)


def test_a_cut_chat_answer_finishes_with_length_and_its_whole_calls():
    choice = chat_choice(0, read_whole(CUTS[0], [], HERMES, None, "length"), "length", None, True)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert named(choice["message"]["tool_calls"]) == KEPT


@pytest.mark.parametrize("seed", range(20))
def test_a_cut_chat_stream_sends_the_whole_call_and_no_raw_text(seed):
    stream = ChatStream(BASE, HERMES)
    chunks = [chunk for delta in pieces(CUTS[0], seed) for chunk in stream.chunks(0, delta)]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    first = [item for d in deltas for item in d.get("tool_calls", []) if item["index"] == 0]
    assert first[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(item["function"]["arguments"] for item in first)) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    # The cut call's start and first arguments went out before the cut: a stream cannot take them back.


def draft() -> ResponseDraft:
    return ResponseDraft("resp_1", "m", {"store": False}, [], None)


def test_a_cut_response_is_incomplete_with_its_whole_calls():
    answer = read_whole(CUTS[0], [], HERMES, None, "length")
    response = draft().finish(output_items(answer), "length", usage(12, 0, 40, 0))
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["name"], json.loads(item["arguments"])) for item in response["output"]] == [
        ("function_call", "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("seed", range(20))
def test_a_cut_response_stream_closes_the_cut_call_incomplete_and_leaves_it_out(seed):
    stream = ResponsesStream(draft(), [Gen()], HERMES, None)
    events = [e for delta in pieces(CUTS[0], seed) for e in stream.chunks(0, delta)] + stream.closing()
    assert not [e for e in events if e["type"] == "response.output_text.delta"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"], json.loads(item["arguments"])) for item in final["output"]] == [
        ("function_call", "completed", {"city": "Paris"})]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["completed", "incomplete"]  # the cut call, as OpenAI closes it


def test_a_cut_messages_answer_keeps_its_whole_tool_use():
    answer = read_whole(CUTS[0], [], HERMES, None, "length")
    assert [(block["type"], block["input"]) for block in content_blocks(answer)] == [("tool_use", {"city": "Paris"})]
    assert stop_reason("length", None, True) == ("max_tokens", None)
