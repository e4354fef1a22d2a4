"""OpenAI response bodies and stream chunks, built from what the generations produced: no I/O here, so
every shape is testable without a server (tests/unit/test_openai_responses.py).

A reasoning model's chat answer is split into `reasoning_content` (also sent as `reasoning`, the name
newer clients read) and `content`; the content of an answer that offered tools is read for tool calls:
content and `tool_calls` apart, `finish_reason: "tool_calls"` when the model stopped after calling
(serving/answers.py reads the parts).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from crane_mp.frontend.serving.answers import AnswerReader, ReasoningReading, ToolReading, WholeAnswer
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.serving.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from crane_mp.protocol import PromptLogprobs


def usage(gens: list, n: int, reasoning: int | None = None) -> dict[str, Any]:
    """Usage over `gens` (prompt i's samples at [i * n, (i + 1) * n)): each prompt counted once;
    `reasoning`: the output tokens spent thinking, where a reasoning parser reads the answers."""
    prompt = sum(g.prompt_tokens for g in gens[::n])
    cached = sum(g.cached_tokens for g in gens[::n])
    completion = sum(g.completion_tokens for g in gens)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def chat_choice(index: int, answer: WholeAnswer, finish_reason: str | None, stop_reason, tools: bool,
                logprobs: dict | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    """One choice of a whole chat completion; `tools`: the answer was read for tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = answer.reasoning
        message["content"] = answer.content or None
    if answer.calls:
        message["tool_calls"] = answer.calls
    choice = {"index": index, "message": message, "logprobs": logprobs,
              "finish_reason": _finish(finish_reason, bool(answer.calls)), "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


@dataclass(slots=True)
class ChatStream:
    """Chunks of a streamed chat completion, choice by choice: the role first, then content and
    `delta.tool_calls` as they are read, the finish last."""

    base: dict[str, Any]
    tools: ToolReading | None
    token_text: TokenText | None = None  # set: logprobs are wanted
    reasoning: ReasoningReading | None = None
    choices: dict[int, AnswerReader] = field(default_factory=dict)

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        reader = self.choices.get(index)
        payloads = []
        if reader is None:
            reader = self.choices[index] = AnswerReader(self.tools, self.reasoning)
            payloads.append(self._chunk(index, {"role": "assistant", "content": ""}))
        piece = reader.feed(delta)
        wants_logprobs = self.token_text is not None and bool(delta.token_ids)
        if not (piece or delta.finish_reason or wants_logprobs):
            return payloads
        body: dict[str, Any] = {}
        if piece.reasoning:
            body["reasoning_content"] = body["reasoning"] = piece.reasoning
        if piece.content:
            body["content"] = piece.content
        if piece.calls:
            body["tool_calls"] = piece.calls
        logprobs = chat_logprobs(self.token_text, delta.token_ids, delta.logprobs) if self.token_text else None
        payloads.append(self._chunk(index, body, logprobs, _finish(delta.finish_reason, reader.called),
                                    delta.stop_reason if delta.finish_reason else None))
        return payloads

    @property
    def reasoning_tokens(self) -> int:
        """Thinking tokens of every choice so far."""
        return sum(reader.reasoning_tokens for reader in self.choices.values())

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason:
            choice["stop_reason"] = stop_reason
        return {**self.base, "choices": [choice]}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason,
                      token_ids: list[int] | None = None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = prompt_ids
    return choice


@dataclass(slots=True)
class CompletionStream:
    """Chunks of a streamed text completion. With echo, a choice's first chunk starts with its prompt
    (and, with logprobs, the prompt's scores); text offsets run on across chunks."""

    base: dict[str, Any]
    n: int
    prompt_texts: list[str]  # per prompt; empty strings without echo
    echo_ids: list[list[int]] | None  # per prompt, with echo
    top_logprobs: int | None
    token_text: TokenText
    prompt_scores: Callable[[int], list[PromptLogprobs]]  # choice index -> its prompt's scores
    sent_prompt: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        prompt_index = index // self.n
        text, logprobs, echo_ids = delta.text, None, None
        if self.echo_ids is not None and index not in self.sent_prompt:
            self.sent_prompt.add(index)
            text = self.prompt_texts[prompt_index] + text
            echo_ids = self.echo_ids[prompt_index]
        if self.top_logprobs is not None:
            logprobs = completion_logprobs(
                self.token_text, delta.token_ids, delta.logprobs, self.top_logprobs, self.offsets.get(index, 0),
                echo_ids, self.prompt_scores(index) if echo_ids else None,
            )
            self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        if not text and not delta.finish_reason and not delta.token_ids:
            return []
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if delta.finish_reason:
            choice["stop_reason"] = delta.stop_reason
        return [{**self.base, "choices": [choice]}]


def embedding_item(index: int, values: bytes, normalize: bool, dimensions: int | None,
                   encoding_format: str) -> dict[str, Any]:
    """One /v1/embeddings entry from a pooled vector (float32 bytes): cut to `dimensions`, then scaled to
    unit length if the model normalises; base64 is the little-endian float32 array, as OpenAI sends it."""
    vector = np.frombuffer(values, dtype=np.float32)[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    vector = vector.astype("<f4")
    embedding = base64.b64encode(vector.tobytes()).decode() if encoding_format == "base64" else vector.tolist()
    return {"object": "embedding", "index": index, "embedding": embedding}
