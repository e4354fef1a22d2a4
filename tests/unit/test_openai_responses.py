"""OpenAI response shapes from the pure builders, without a server: usage over n samples, chat choices
with and without tool calls, and the chunk sequences of streamed chat and text completions."""

from __future__ import annotations

from dataclasses import dataclass

from crane_mp.frontend.openai.bodies import ChatStream, CompletionStream, chat_choice, completion_choice, usage
from crane_mp.frontend.serving.answers import ToolReading, read_whole
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.tools.formats import FORMATS
from crane_mp.protocol import PromptLogprobs, TokenLogprobs

BASE = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}


@dataclass
class Gen:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def test_usage_counts_each_prompt_once_and_every_sample():
    gens = [Gen(10, 4, 3), Gen(10, 4, 5), Gen(7, 0, 1), Gen(7, 0, 2)]  # two prompts, n = 2
    assert usage(gens, 2) == {"prompt_tokens": 17, "completion_tokens": 11, "total_tokens": 28,
                              "prompt_tokens_details": {"cached_tokens": 4}}


def test_chat_choice_plain_and_with_tool_calls():
    plain = chat_choice(0, read_whole("hello", [], None, None), "stop", None, False)
    assert plain == {"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
                     "finish_reason": "stop", "stop_reason": None}
    tools = ToolReading(FORMATS["hermes"])
    called = chat_choice(1, read_whole('<tool_call>{"name": "f", "arguments": {}}</tool_call>', [], tools, None),
                         "stop", 7, True, None, [1, 2])
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert called["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert called["token_ids"] == [1, 2] and called["stop_reason"] == 7
    cut = chat_choice(0, read_whole('<tool_call>{"name": "f", "arguments": {', [], tools, None), "length", None, True)
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]


def test_chat_stream_sends_the_role_first_then_content_then_the_finish():
    stream = ChatStream(BASE, None, token_text)
    lp = TokenLogprobs(-0.5, [3], [-0.5])
    chunks = stream.chunks(0, Delta("Hi", [3], [lp]))
    chunks += stream.chunks(0, Delta("", [], [], "stop", 9))
    choices = [c["choices"][0] for c in chunks]
    assert all(c["id"] == "x" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert choices[1]["delta"] == {"content": "Hi"}
    assert choices[1]["logprobs"]["content"][0]["token"] == "<3>"
    assert choices[2]["finish_reason"] == "stop" and choices[2]["stop_reason"] == 9 and choices[2]["delta"] == {}


def test_chat_stream_with_tools_holds_the_marker_and_ends_with_tool_calls():
    stream = ChatStream(BASE, ToolReading(FORMATS["hermes"]))
    chunks = stream.chunks(0, Delta("Ok <tool", [1]))
    chunks += stream.chunks(0, Delta('_call>{"name": "f", "argu', [2]))
    chunks += stream.chunks(0, Delta('ments": {"a": 1}}</tool_call>', [3], [], "stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Ok "
    items = [item for d in deltas for item in d.get("tool_calls", [])]
    assert items[0]["function"]["name"] == "f"
    assert "".join(i["function"]["arguments"] for i in items) == '{"a": 1}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_stream_echoes_each_prompt_once_with_running_offsets():
    prompt_scores = [PromptLogprobs(0, 1, [-1.0], [[]], [[]])]
    stream = CompletionStream({"id": "c"}, 2, ["P0", "P1"], [[5, 6], [7, 8]], 0, token_text,
                              lambda index: prompt_scores)
    first = stream.chunks(2, Delta("a", [1], [TokenLogprobs(-0.1, [], [])]))[0]["choices"][0]
    assert first["text"] == "P1a" and first["index"] == 2
    assert first["logprobs"]["tokens"] == ["<7>", "<8>", "<1>"]
    second = stream.chunks(2, Delta("b", [2], [TokenLogprobs(-0.2, [], [])], "length"))[0]["choices"][0]
    assert second["text"] == "b" and second["logprobs"]["text_offset"] == [9]
    assert second["finish_reason"] == "length"
    assert stream.chunks(3, Delta("", [], []))[0]["choices"][0]["text"] == "P1"


def test_completion_choice_carries_token_ids_only_when_asked():
    assert "token_ids" not in completion_choice(0, "t", None, "stop", None)
    choice = completion_choice(0, "t", None, "stop", None, [4], [1, 2])
    assert choice["token_ids"] == [4] and choice["prompt_token_ids"] == [1, 2]
