"""Reading a chat answer for what every chat-shaped API returns apart: the thinking (reasoning.py), the
content, and the tool calls (tools/parser.py), whole or as the answer streams. The OpenAI chat,
Responses and Anthropic Messages renderers all read answers here and differ only in how they write
the parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.serving.reasoning import THINK, Markers, make_splitter, reasoning_tokens, split_reasoning
from crane_mp.frontend.tools.formats import ToolFormat
from crane_mp.frontend.tools.gemma4_calls import Gemma4CallParser
from crane_mp.frontend.tools.harmony_calls import HarmonyCallParser
from crane_mp.frontend.tools.parser import ToolCallParser, parse_with
from crane_mp.frontend.tools.xml_calls import XmlCallParser


@dataclass(frozen=True, slots=True)
class ReasoningReading:
    """How to read an answer for thinking: its mode (reasoning.reading_mode), and the `</think>` token,
    by which thinking tokens are counted."""

    mode: str
    end_token: int | None
    markers: Markers = THINK

    def split(self, text: str, token_ids: list[int]) -> tuple[str | None, str, int]:
        """(reasoning or None, content, thinking tokens) of a whole answer."""
        reasoning, content = split_reasoning(self.mode, text, self.markers)
        return reasoning, content, reasoning_tokens(token_ids, self.end_token, reasoning is not None)


@dataclass(frozen=True, slots=True)
class ToolReading:
    """How to read an answer for tool calls: the model's format, and whether several calls may stand."""

    fmt: ToolFormat
    parallel: bool = True
    tools: list[dict] | None = None  # the offered tools: XML calls' parameters are typed by their schemas

    def parser(self) -> ToolCallParser:
        if self.fmt.xml:
            return XmlCallParser(self.fmt, self.parallel, self.tools)
        if self.fmt.gemma:
            return Gemma4CallParser(self.fmt, self.parallel)
        if self.fmt.harmony:
            return HarmonyCallParser(self.fmt, self.parallel)
        return ToolCallParser(self.fmt, self.parallel)


@dataclass(slots=True)
class WholeAnswer:
    """A finished answer's parts: calls as OpenAI chat `tool_calls` ({id, type, function: {name,
    arguments}}), None when it made none (or made malformed ones, left in the content)."""

    reasoning: str | None
    content: str | None
    calls: list[dict] | None
    reasoning_tokens: int = 0


def read_whole(text: str, token_ids: list[int], tools: ToolReading | None,
               thinking: ReasoningReading | None, finish_reason: str | None = None) -> WholeAnswer:
    """A finished answer's parts; one that max_tokens cut keeps the calls it finished."""
    reasoning, tokens = None, 0
    if thinking is not None:
        reasoning, text, tokens = thinking.split(text, token_ids)
    cut = finish_reason == "length"
    content, calls = (text, None) if tools is None else parse_with(tools.parser(), text, cut)
    return WholeAnswer(reasoning, content, calls, tokens)


@dataclass(slots=True)
class AnswerPiece:
    """What one delta of an answer added: thinking text, content text, and OpenAI chat
    `delta.tool_calls` items ({index, id, type, function: {name, arguments}} when a call starts, then
    {index, function: {arguments}} pieces)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class AnswerReader:
    """One answer read as it streams: feed each delta, get its piece; text held back (a tag or marker
    cut across deltas) comes out with the delta that carries the finish."""

    def __init__(self, tools: ToolReading | None, thinking: ReasoningReading | None) -> None:
        self.parser = tools.parser() if tools else None
        self.splitter = make_splitter(thinking.mode, thinking.markers) if thinking else None
        self.end_token = thinking.end_token if thinking else None
        self.token_ids: list[int] = []  # with thinking: to count its tokens
        self.finish_reason: str | None = None

    def feed(self, delta: Delta) -> AnswerPiece:
        reasoning, content, calls = "", delta.text, []
        self.finish_reason = delta.finish_reason or self.finish_reason
        if self.splitter is not None:
            self.token_ids += delta.token_ids
            reasoning, content = self.splitter.feed(delta.text)
            if delta.finish_reason:
                more_reasoning, more_content = self.splitter.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.parser is not None:
            content, calls = self.parser.feed(content)
            if delta.finish_reason:
                rest, more = self.parser.finish()
                content, calls = content + rest, calls + more
        return AnswerPiece(reasoning, content, calls)

    @property
    def called(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)

    @property
    def cut_calls(self) -> set[int]:
        """The calls streamed so far that the whole answer drops (read_whole): those max_tokens cut off.
        Their deltas are sent already; an API whose answer ends with a final object leaves them out of it."""
        if self.parser is None or self.finish_reason != "length":
            return set()
        return set(range(len(self.parser.kept_calls(True)), len(self.parser.calls)))

    @property
    def reasoning_tokens(self) -> int:
        """Thinking tokens so far, counted as ReasoningReading counts a whole answer's."""
        if self.splitter is None:
            return 0
        return reasoning_tokens(self.token_ids, self.end_token, self.splitter.thought)
