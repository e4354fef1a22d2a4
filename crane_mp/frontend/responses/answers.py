"""The Responses API's output: the response object, its output items (reasoning, message, function
calls) from a read answer (serving/answers.py), and the streamed event sequence the `openai` SDK's
`responses.stream` accumulates (response.created, output items added and done, text and argument
deltas, response.completed). No I/O here but the store's, so every shape is testable without a server.

Asked for, the output_text carries the logprobs of the answer's tokens after its thinking, in the chat
API's shape (logprobs_format.py), which is the Responses API's too; a stream sends each delta's with it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from crane_mp.frontend.openai.schemas import arguments_object
from crane_mp.frontend.responses.store import ResponseStore
from crane_mp.frontend.serving.answers import AnswerReader, ReasoningReading, ToolReading, WholeAnswer
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.serving.logprobs_format import TokenText, chat_logprobs
from crane_mp.frontend.web.errors import error_body
from crane_mp.frontend.web.http import named_sse_event


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; cache_write_tokens counts tokens written to a paid prompt cache, which this
    server's prefix cache has no counterpart of (0), but clients require the field."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def text_logprobs(token_text: TokenText | None, token_ids: list[int], logprobs: list, thought: int) -> list:
    """The output_text's logprobs: those of the tokens after the first `thought` (its thinking's);
    none where they were not asked for (no `token_text`)."""
    if token_text is None:
        return []
    return chat_logprobs(token_text, token_ids[thought:], logprobs[thought:])["content"]


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(answer: WholeAnswer, logprobs: list | None = None) -> list[dict[str, Any]]:
    """A whole answer's items: its thinking, its text (also an empty one when the answer has neither
    thinking nor calls) with `logprobs`, its calls."""
    items = []
    if answer.reasoning is not None:
        items.append(reasoning_item(_item_id("rs"), answer.reasoning))
    if answer.content or not (answer.calls or answer.reasoning is not None):
        items.append(message_item(_item_id("msg"), answer.content or "", logprobs=logprobs))
    for call in answer.calls or []:
        items.append(call_item(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def answer_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the next turn's chat-template message (thinking is not fed back)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": item["call_id"], "type": "function", "function": {
        "name": item["name"], "arguments": arguments_object(item["arguments"])}}
        for item in items if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass(slots=True)
class ResponseDraft:
    """What a response echoes of its request, and where it is kept (`store`)."""

    response_id: str
    model: str
    request: dict[str, Any]  # the request fields the response object repeats
    messages: list[dict[str, Any]]  # the conversation so far, for a later previous_response_id
    store: ResponseStore | None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None,
                 incomplete: str | None = None) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "model": self.model, "output": output, "usage": usage_, **self.request}

    def finish(self, output: list[dict[str, Any]], finish_reason: str | None, usage_: dict[str, Any]) -> dict:
        """The final response object, kept when the request asked to store it."""
        cut = finish_reason in ("length", "abort")
        response = self.response("incomplete" if cut else "completed", output, usage_,
                                 "max_output_tokens" if cut else None)
        if self.store is not None and self.request["store"]:
            self.store.put(self.response_id, {"response": response,
                                              "messages": [*self.messages, answer_message(output)]})
        return response


class ResponsesStream:
    """The events of a streamed response. Items open as the answer reaches them (thinking, then text,
    then each call) and close when the next begins; every item is done before response.completed."""

    def __init__(self, draft: ResponseDraft, gens: list, tools: ToolReading | None,
                 thinking: ReasoningReading | None, token_text: TokenText | None = None) -> None:
        self.draft = draft
        self.gens = gens
        self.reader = AnswerReader(tools, thinking)
        self.token_text = token_text  # set: the text's logprobs are wanted
        self.tokens = 0  # the answer's tokens so far
        self.logprobs: list[dict[str, Any]] = []  # of text tokens whose text has not been sent yet
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # every item, by output index
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # the chat parser's call index -> its item
        self.finish_reason: str | None = None

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        events = []
        if self.sequence == 0:
            started = self.draft.response("in_progress", [], None)
            events += [self._event("response.created", response=started),
                       self._event("response.in_progress", response=started)]
        piece = self.reader.feed(delta)
        start, self.tokens = self.tokens, self.tokens + len(delta.token_ids)
        thought = max(0, self.reader.reasoning_tokens - start)  # of this delta's tokens
        self.logprobs += text_logprobs(self.token_text, delta.token_ids, delta.logprobs, thought)
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for call in piece.calls:
            events += self._call(call)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        return events

    def closing(self) -> list[dict[str, Any]]:
        events = self._close_open()
        if not self.items:  # an answer with no text at all still has its (empty) message
            events += self._text("message", "") + self._close_open()
        cut = self.reader.cut_calls  # closed as incomplete, and left out of the response as a whole answer leaves them
        for index, item in self.calls.items():
            item["status"] = "incomplete" if index in cut else "completed"
            events += [self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=self.items.index(item), name=item["name"],
                                   arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=self.items.index(item), item=item)]
        dropped = [self.calls[index]["id"] for index in cut]
        output = [item for item in self.items if item["id"] not in dropped]
        gen = self.gens[0]
        final = self.draft.finish(output, self.finish_reason, usage(
            gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens, self.reader.reasoning_tokens))
        return events + [self._event("response.completed", response=final)]

    event_bytes = staticmethod(named_sse_event)

    end_bytes = b""

    def error_payload(self, status: int, message: str) -> dict[str, Any]:
        body = error_body(status, message)["error"]
        return self._event("error", code=body["type"], message=message, param=None)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close_open()
            item = (reasoning_item(_item_id("rs"), "", "in_progress") if kind == "reasoning"
                    else message_item(_item_id("msg"), "", "in_progress"))
            item["content"] = []
            self.open = item
            self.items.append(item)
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events += [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                   item={**item, "content": []}),
                       self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.items) - 1, content_index=0, part=dict(part))]
            item["content"].append(part)
        if text:
            self.open["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": self._take_logprobs(self.open["content"][0])}
            events.append(self._event(name, item_id=self.open["id"], output_index=len(self.items) - 1,
                                      content_index=0, delta=text, **extra))
        return events

    def _close_open(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"])
        else:
            self._take_logprobs(part)  # tokens after its last text (a stop token's, say)
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=part["logprobs"])
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _take_logprobs(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        """The logprobs held for a message's text, added to its output_text `part` (as a new list: the
        events already made keep theirs)."""
        taken, self.logprobs = self.logprobs, []
        part["logprobs"] = part["logprobs"] + taken
        return taken

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "id" in call:  # a call starts: its name is known
            events += self._close_open()
            item = call_item(_item_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
            self.calls[call["index"]] = item
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(item)))
        item = self.calls[call["index"]]
        arguments = call["function"].get("arguments", "")
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=arguments))
        return events
