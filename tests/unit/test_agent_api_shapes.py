"""The Responses API's and Anthropic Messages' shapes from the pure builders, without a server: input
translation, whole answers, and the streamed events in every chunking of an answer that thinks,
writes text and calls tools (each item or block opened once and closed, deltas that concatenate to
the whole answer's parts), and the response store's bounds."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from crane_mp.frontend.anthropic.answers import MessageDraft, MessagesStream, content_blocks, stop_reason
from crane_mp.frontend.anthropic.schemas import MessagesRequest, chat_messages, image_source_url
from crane_mp.frontend.openai.schemas import decode_body
from crane_mp.frontend.responses import store as response_store
from crane_mp.frontend.responses.answers import ResponseDraft, ResponsesStream, output_items, text_logprobs
from crane_mp.frontend.responses.schemas import input_image_url, input_messages
from crane_mp.frontend.responses.store import ResponseStore, new_response_id
from crane_mp.frontend.serving.answers import ReasoningReading, ToolReading, read_whole
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.serving.logprobs_format import TokenText
from crane_mp.frontend.serving.message_parts import ImageParts, stored_images
from crane_mp.frontend.serving.reasoning import THINKING as THINKING_MODE
from crane_mp.frontend.tools.formats import FORMATS
from crane_mp.frontend.web.errors import ApiError
from crane_mp.protocol import TokenLogprobs

THOUGHT = "I should look the weather up."
TEXT = "Let me check."
CALLS = ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
         '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
ANSWER = f"<think>{THOUGHT}</think>{TEXT}{CALLS}"
TOOLS = ToolReading(FORMATS["hermes"])
THINKING = ReasoningReading(THINKING_MODE, None)


@dataclass
class Gen:
    prompt_tokens: int = 12
    cached_tokens: int = 4
    completion_tokens: int = 30


def pieces(text: str, seed: int) -> list[Delta]:
    """`text` cut at random places, the last piece carrying the finish."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 25)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [Delta(part, [1], finish_reason="stop" if i == len(parts) - 1 else None) for i, part in enumerate(parts)]


def test_whole_answers_become_items_and_blocks():
    answer = read_whole(ANSWER, [], TOOLS, THINKING)
    items = output_items(answer)
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == THOUGHT and items[1]["content"][0]["text"] == TEXT
    assert json.loads(items[2]["arguments"]) == {"city": "Paris", "days": [1, 2]} and items[3]["name"] == "time"
    blocks = content_blocks(answer)
    assert [block["type"] for block in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert blocks[2]["input"] == {"city": "Paris", "days": [1, 2]} and blocks[3]["input"] == {}
    assert [b["type"] for b in content_blocks(read_whole("", [], TOOLS, None))] == ["text"]
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 7, True) == ("tool_use", None)
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("stop", 7, False) == ("end_turn", None)


@pytest.mark.parametrize("seed", range(20))
def test_responses_events_in_any_chunking(tmp_path, seed):
    store = ResponseStore(tmp_path)
    draft = ResponseDraft(new_response_id(), "m", {"store": True}, [{"role": "user", "content": "hi"}], store)
    stream = ResponsesStream(draft, [Gen()], TOOLS, THINKING)
    events = [e for delta in pieces(ANSWER, seed) for e in stream.chunks(0, delta)] + stream.closing()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    added = {e["output_index"]: e["item"]["id"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert added == {index: item["id"] for index, item in done.items()} and len(added) == 4
    final = events[-1]["response"]
    assert [item["id"] for item in final["output"]] == [added[i] for i in range(4)]
    text = {kind: "".join(e["delta"] for e in events if e["type"] == kind)
            for kind in ("response.reasoning_text.delta", "response.output_text.delta")}
    assert text == {"response.reasoning_text.delta": THOUGHT, "response.output_text.delta": TEXT}
    for index in (2, 3):
        arguments = "".join(e["delta"] for e in events
                            if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == index)
        assert arguments == done[index]["arguments"] and isinstance(json.loads(arguments), dict)
    assert final["status"] == "completed"
    kept = store.get(draft.response_id)
    assert kept["response"] == final
    assert kept["messages"][-1]["content"] == TEXT and len(kept["messages"][-1]["tool_calls"]) == 2


@pytest.mark.parametrize("seed", range(20))
def test_anthropic_events_in_any_chunking(seed):
    stream = MessagesStream(MessageDraft("msg_1", "m"), [Gen()], TOOLS, THINKING)
    events = [e for delta in pieces(ANSWER, seed) for e in stream.chunks(0, delta)] + stream.closing()
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == stops == [0, 1, 2, 3]
    assert [e["content_block"]["type"] for e in starts] == ["thinking", "text", "tool_use", "tool_use"]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert all(stops.index(d["index"]) >= 0 for d in deltas)
    assert "".join(d["delta"].get("thinking", "") for d in deltas) == THOUGHT
    assert "".join(d["delta"].get("text", "") for d in deltas) == TEXT
    inputs = ["".join(d["delta"]["partial_json"] for d in deltas if d["index"] == i) for i in (2, 3)]
    assert [json.loads(text) for text in inputs] == [{"city": "Paris", "days": [1, 2]}, {}]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["input_tokens"] + events[-2]["usage"]["cache_read_input_tokens"] == Gen.prompt_tokens


def test_responses_input_items_become_chat_turns():
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ])
    # Text parts stay parts: the renderer gives them to the template as it reads them.
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert messages[1]["role"] == "assistant" and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    with pytest.raises(ApiError, match=r"input\[0\].content\[0\]: only text parts"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(ApiError, match="item_reference"):
        input_messages([{"type": "item_reference", "id": "x"}])


def test_responses_input_images_are_collected_in_order_and_kept_for_a_follow_up():
    images = ImageParts(("input_image",), input_image_url)
    messages = input_messages([{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        {"type": "input_text", "text": "and"}, {"type": "input_image", "image_url": {"url": "https://x/y.png"}}]}],
        images)
    assert messages[0]["content"] == [{"type": "image", "url": "data:image/png;base64,AAAA"},
                                      {"type": "text", "text": "and"}, {"type": "image", "url": "https://x/y.png"}]
    assert images.found == [("input[0].content[0]", "data:image/png;base64,AAAA"),
                            ("input[0].content[2]", "https://x/y.png")]
    assert stored_images(messages, "earlier") == [("earlier", url) for _, url in images.found]
    with pytest.raises(ApiError, match=r"input\[0\].content\[0\]: an input_image needs image_url"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
                       ImageParts(("input_image",), input_image_url))


def test_anthropic_turns_become_chat_turns():
    req = decode_body(json.dumps({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
                                  "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "42"}]}, {"type": "text", "text": "thanks"}]},
    ]}).encode(), MessagesRequest)
    messages = chat_messages(req)
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    assert messages[2] == {"role": "assistant", "content": [{"type": "text", "text": "calling"}], "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert messages[3:] == [{"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "42"}]},
                            {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]
    image = decode_body(json.dumps({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}).encode(), MessagesRequest)
    with pytest.raises(ApiError, match="'image' blocks are not supported"):
        chat_messages(image)


def test_anthropic_image_blocks_keep_their_place_among_the_text():
    req = decode_body(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}).encode(), MessagesRequest)
    images = ImageParts(("image",), image_source_url)
    assert chat_messages(req, images)[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "image", "url": "data:image/jpeg;base64,/9j/"},
        {"type": "image", "url": "https://x/y.png"}]
    assert [where for where, _ in images.found] == ["messages[0].content[1]", "messages[0].content[2]"]
    for source, error in (({"type": "file", "file_id": "f"}, "'file' image sources are not supported"),
                          ({"type": "base64", "data": "AA"}, r"source.media_type must be a string")):
        bad = decode_body(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}]}]}).encode(), MessagesRequest)
        with pytest.raises(ApiError, match=error):
            chat_messages(bad, ImageParts(("image",), image_source_url))


def test_the_store_keeps_the_newest_within_its_bounds(tmp_path, monkeypatch):
    monkeypatch.setattr(response_store, "MAX_RESPONSES", 3)
    store = ResponseStore(tmp_path)
    ids = [new_response_id() for _ in range(5)]
    for i, response_id in enumerate(ids):
        assert store.put(response_id, {"response": {"n": i}, "messages": []})
    assert [store.get(i) is not None for i in ids] == [False, False, True, True, True]
    assert store.get("../../etc/passwd") is None and not store.put("resp_../x", {})
    monkeypatch.setattr(response_store, "MAX_RECORD", 10)
    assert not store.put(new_response_id(), {"response": "x" * 100, "messages": []})
    assert store.delete(ids[-1]) and store.get(ids[-1]) is None and not store.delete(ids[-1])


class _Vocabulary:
    def decode(self, ids: list[int]) -> str:
        return f"t{ids[0]}"


END_THINK = 99
# An answer that thinks, then writes its text: (text, token ids) per delta, the </think> token in the second.
THOUGHT_THEN_TEXT = [("<think>I should", [10, 11]), (" look</think>", [12, END_THINK]), ("Let me", [20, 21]),
                     (" check.", [22])]


def _logprobs(ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(-0.1 * i, [i, 7], [-0.1 * i, -3.0]) for i in ids]


def test_the_output_text_carries_the_logprobs_of_the_tokens_after_the_thinking_in_the_sdk_shape(tmp_path):
    from openai.types.responses import ResponseOutputText, ResponseTextDeltaEvent, ResponseTextDoneEvent, ResponseUsage

    token_text, thinking = TokenText(_Vocabulary()), ReasoningReading(THINKING_MODE, END_THINK)
    draft = ResponseDraft(new_response_id(), "m", {"store": False}, [], None)
    stream = ResponsesStream(draft, [Gen()], None, thinking, token_text)
    deltas = [Delta(text, ids, _logprobs(ids), finish_reason="stop" if i == 3 else None)
              for i, (text, ids) in enumerate(THOUGHT_THEN_TEXT)]
    events = [e for delta in deltas for e in stream.chunks(0, delta)] + stream.closing()
    sent = [lp for e in events if e["type"] == "response.output_text.delta"
            for lp in ResponseTextDeltaEvent.model_validate(e).logprobs]
    assert [(lp.token, lp.logprob) for lp in sent] == [("t20", -2.0), ("t21", -2.1), ("t22", -2.2)]
    [done] = [ResponseTextDoneEvent.model_validate(e) for e in events if e["type"] == "response.output_text.done"]
    ResponseUsage.model_validate(events[-1]["response"]["usage"])  # every field the SDK requires
    [message] = [item for item in events[-1]["response"]["output"] if item["type"] == "message"]
    streamed = ResponseOutputText.model_validate(message["content"][0])
    ids = [token for _, tokens in THOUGHT_THEN_TEXT for token in tokens]
    answer = read_whole("".join(text for text, _ in THOUGHT_THEN_TEXT), ids, None, thinking)
    [whole] = [item for item in output_items(answer, text_logprobs(token_text, ids, _logprobs(ids),
                                                                   answer.reasoning_tokens))
               if item["type"] == "message"]
    assert ResponseOutputText.model_validate(whole["content"][0]) == streamed
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in streamed.logprobs] == ["t20", "t21", "t22"]
    assert [(top.token, top.logprob, top.bytes) for top in streamed.logprobs[0].top_logprobs] == \
        [("t20", -2.0, list(b"t20")), ("t7", -3.0, list(b"t7"))]
    plain = ResponsesStream(draft, [Gen()], None, thinking)  # not asked for: none
    events = [e for delta in deltas for e in plain.chunks(0, delta)] + plain.closing()
    assert all(e["logprobs"] == [] for e in events if e["type"].startswith("response.output_text."))
