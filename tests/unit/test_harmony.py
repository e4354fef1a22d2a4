"""gpt-oss's harmony answers read apart: analysis as reasoning, final (and preambles) as content,
commentary messages to functions as tool calls; whole, and streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from crane_mp.frontend.serving.answers import AnswerReader, ReasoningReading, ToolReading, read_whole
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.serving.reasoning import HARMONY, LEADING, reasoning_markers
from crane_mp.frontend.tools.formats import FORMATS, tool_format

THINKING = ReasoningReading(LEADING, None, HARMONY)
TOOLS = ToolReading(FORMATS["openai"])
WEATHER = '{"city": "Paris", "days": 3}'

ANSWERS = {
    "final": ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>"
              "Hello there!", "The user greets.", "Hello there!", []),
    "call": ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
             f"to=functions.get_weather <|constrain|>json<|message|>{WEATHER}", "Need weather.", None,
             [("get_weather", WEATHER)]),
    # the recipient before the channel, a preamble, two calls, and the closing tags in the text
    "calls": ("<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.a"
              '<|channel|>commentary json<|message|>{"x": 1}<|call|><|start|>assistant<|channel|>commentary '
              'to=functions.b<|message|>{"y": [2]}<|call|>', None, "Checking both.", [("a", '{"x": 1}'),
                                                                                   ("b", '{"y": [2]}')]),
    "no header": ('{"answer": 42}', None, '{"answer": 42}', []),
}


def _read_streamed(text: str, size: int, finish: str = "stop"):
    reader = AnswerReader(TOOLS, THINKING)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        got = reader.feed(Delta(piece, [1], finish_reason=finish if i == len(pieces) - 1 else None))
        reasoning, content = reasoning + got.reasoning, content + got.content
        for delta in got.calls:
            call = calls.setdefault(delta["index"], ["", ""])
            call[0] += delta["function"].get("name", "")
            call[1] += delta["function"]["arguments"]
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], reader


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_whole_answer_is_read_by_its_channels(name):
    text, reasoning, content, calls = ANSWERS[name]
    answer = read_whole(text, [], TOOLS, THINKING)
    assert answer.reasoning == reasoning
    assert answer.content == content
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in answer.calls or []]
    assert got == calls and all(json.loads(arguments) for _, arguments in got)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_streamed_answer_reads_the_same_in_pieces_of_any_size(name, size):
    text, reasoning, content, calls = ANSWERS[name]
    got_reasoning, got_content, got_calls, _ = _read_streamed(text, size)
    assert got_reasoning == (reasoning or "")
    assert got_content == ("" if calls and content is None else content or "")
    assert got_calls == calls


def test_a_call_cut_by_max_tokens_is_dropped_and_a_cut_thought_is_reasoning():
    text = ('<|channel|>analysis<|message|>Need<|end|><|start|>assistant<|channel|>commentary to=functions.f'
            '<|message|>{"a')
    answer = read_whole(text, [], TOOLS, THINKING, finish_reason="length")
    assert answer.reasoning == "Need" and answer.calls is None
    _, _, _, reader = _read_streamed(text, 4, finish="length")
    assert reader.cut_calls == {0}
    assert read_whole("<|channel|>analysis<|message|>Still thin", [], TOOLS, THINKING,
                      finish_reason="length").reasoning == "Still thin"


def test_the_vocabulary_and_the_architecture_choose_harmony():
    vocabulary = {tag: i for i, tag in enumerate(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>"])}
    assert reasoning_markers("auto", vocabulary) is HARMONY
    assert tool_format("auto", "llama", vocabulary) is FORMATS["openai"]
    assert tool_format("auto", "gpt_oss") is FORMATS["openai"]
