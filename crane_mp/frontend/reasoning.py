"""Reasoning models' thinking, apart from their answer: Qwen3 writes `<think> ... </think>` and then the
answer; DeepSeek-R1 (and Qwen3's thinking-only releases) get `<think>` from their chat template at the
end of the prompt and write the thinking, `</think>`, the answer. One rule serves both: a response is
thinking from its start when the prompt left a `<think>` open, or when it starts with `<think>`; the
thinking ends at `</think>`; the rest is the answer (a response with neither is all answer).

The split is lossless: (the opening tag the response wrote) + reasoning + `</think>` + content is the
response's text, however the text arrives in pieces (a tag cut across pieces is held back until it is
whole or proves not to be one).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


def reasoning_enabled(parser: str, added_vocab: dict[str, int]) -> bool:
    """--reasoning-parser: qwen3 and deepseek_r1 read the same tags (what differs, whether the prompt
    opens the thinking, is seen per request); auto reads them when the vocabulary has both as tokens."""
    if parser == "auto":
        return START in added_vocab and END in added_vocab
    return parser != "none"


def prompt_opens_thinking(prompt: str) -> bool:
    """The rendered prompt ends inside a think block (R1's template: the response starts thinking)."""
    return prompt.rfind(START) > prompt.rfind(END)


@dataclass(slots=True)
class ReasoningSplitter:
    """Feed a response's text piece by piece; each feed returns the (reasoning, content) it can tell
    apart so far."""

    state: str = "start"  # start: a leading <think> may come; thinking; answer
    held: str = ""
    ended: bool = False  # </think> was seen

    @classmethod
    def opening(cls, opened: bool) -> ReasoningSplitter:
        """A splitter for an answer whose prompt `opened` a think block (prompt_opens_thinking) or not."""
        return cls("thinking" if opened else "start")

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = content = ""
        if self.state == "start":
            if text.startswith(START):
                self.state, text = "thinking", text[len(START):]
            elif START.startswith(text):
                self.held = text  # may still become <think>
                return "", ""
            else:
                self.state = "answer"
        if self.state == "thinking":
            end = text.find(END)
            if end < 0:
                keep = _partial_suffix(text, END)
                self.held = text[len(text) - keep:] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END):]
            self.state, self.ended = "answer", True
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end of the response."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)

    @property
    def thought(self) -> bool:
        """The answer has thought so far (it is thinking, or its thinking ended)."""
        return self.state == "thinking" or self.ended


def split_reasoning(opened: bool, text: str) -> tuple[str | None, str]:
    """A whole response's (reasoning, content); reasoning None when the response did not think."""
    splitter = ReasoningSplitter.opening(opened)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.thought else None), content + more_content


def reasoning_tokens(token_ids: list[int], end_token: int | None, thought: bool) -> int:
    """Output tokens spent thinking: up to and including `</think>`, all of them when it never came."""
    if not thought:
        return 0
    if end_token is not None and end_token in token_ids:
        return token_ids.index(end_token) + 1
    return len(token_ids)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
