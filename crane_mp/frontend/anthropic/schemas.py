"""Anthropic's Messages API request bodies (/v1/messages, /v1/messages/count_tokens) as msgspec Structs,
and their translation into chat-template messages. Fields this server does not act on (metadata,
cache_control, service_tier, ...) are accepted and ignored, as Claude-Code-style clients send them;
image and document blocks are a 400.

Content blocks differ by type, so they are decoded as objects and read by `chat_messages`;
MESSAGES_SCHEMA states their shapes for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from crane_mp.frontend.openai.schemas import FunctionName
from crane_mp.frontend.serving.message_parts import string_field, text_content
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.fields import Count, PositiveCount, StopString, TopK, TopP


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicThinking(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Count | None = None


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    """Structured output (`format`); `effort` is accepted and left to the model."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesFields(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[AnthropicTool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(MessagesFields, kw_only=True):
    max_tokens: PositiveCount
    stop_sequences: Annotated[list[StopString], msgspec.Meta(max_length=16)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesFields, kw_only=True):
    pass


_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"}}}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    "is_error": {"type": "boolean"}}}
# The turns chat_messages reads (for /openapi.json): the user's text and tool results, the assistant's
# text and tool calls. An assistant's thinking blocks are accepted too, and skipped (thinking is not
# fed back): left out here, as a turn of thinking alone would be no turn.
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "user"}, "content": {
        "anyOf": [{"type": "string"},
                  {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT_BLOCK, _TOOL_RESULT]}}]}}},
    {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "assistant"}, "content": {
        "anyOf": [{"type": "string"},
                  {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT_BLOCK, _TOOL_USE]}}]}}},
]}}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}],
                 "default": None}


def chat_messages(req: MessagesFields) -> list[dict[str, Any]]:
    """The system prompt and messages as chat-template messages: a user turn's tool results become tool
    turns (before its text), an assistant turn's tool_use blocks its tool_calls."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": text_content(req.system, "system", "system", ("text",))})
    for index, message in enumerate(req.messages):
        where = f"messages[{index}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for number, block in enumerate(message.content):
            kind, at = block.get("type"), f"{where}[{number}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": string_field(block, "id", at, "messages"), "type": "function", "function": {
                    "name": string_field(block, "name", at, "messages"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and message.role == "user":
                result = text_content(block.get("content", ""), f"{at}.content", "messages", ("text",))
                messages.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at, "messages"),
                                 "content": result})
            elif kind not in ("thinking", "redacted_thinking"):
                raise ApiError(400, f"{at}: {kind!r} blocks are not supported in a {message.role} turn "
                                    "(text, tool_use from the assistant, tool_result from the user)", "messages")
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": [{"type": "text", "text": text} for text in texts]
                                    if texts else ""}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    return messages
