"""Anthropic's Messages API request bodies (/v1/messages, /v1/messages/count_tokens) as msgspec Structs,
and their translation into chat-template messages. Fields this server does not act on (metadata,
cache_control, service_tier, ...) are accepted and ignored, as Claude-Code-style clients send them;
image blocks (base64 and URL sources) are read into the request's images; document blocks are a 400.

Content blocks differ by type, so they are decoded as objects and read by `chat_messages`;
MESSAGES_SCHEMA states their shapes for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from crane_mp.frontend.openai.schemas import FunctionName
from crane_mp.frontend.serving.message_parts import ImageParts, string_field, text_content
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
_IMAGE_BLOCK = {"type": "object", "required": ["type", "source"], "properties": {
    "type": {"const": "image"}, "source": {"anyOf": [
        {"type": "object", "required": ["type", "media_type", "data"], "properties": {
            "type": {"const": "base64"}, "media_type": {"type": "string"}, "data": {"type": "string"}}},
        {"type": "object", "required": ["type", "url"], "properties": {
            "type": {"const": "url"}, "url": {"type": "string"}}}]}}}
# The turns chat_messages reads (for /openapi.json): the user's text, images and tool results, the assistant's
# text and tool calls. An assistant's thinking blocks are accepted too, and skipped (thinking is not
# fed back): left out here, as a turn of thinking alone would be no turn.
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "user"}, "content": {
        "anyOf": [{"type": "string"},
                  {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT_BLOCK, _IMAGE_BLOCK, _TOOL_RESULT]}}]}}},
    {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": "assistant"}, "content": {
        "anyOf": [{"type": "string"},
                  {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT_BLOCK, _TOOL_USE]}}]}}},
]}}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}],
                 "default": None}


def image_source_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 bytes as a data: URL, a url source as it is."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ApiError(400, f"{where}.source must be an object (base64 or url)", "messages")
    kind = source.get("type")
    if kind == "base64":
        media_type = string_field(source, "media_type", f"{where}.source", "messages")
        return f"data:{media_type};base64,{string_field(source, 'data', f'{where}.source', 'messages')}"
    if kind == "url":
        return string_field(source, "url", f"{where}.source", "messages")
    raise ApiError(400, f"{where}.source: {kind!r} image sources are not supported (base64, url)", "messages")


def chat_messages(req: MessagesFields, images: ImageParts | None = None) -> list[dict[str, Any]]:
    """The system prompt and messages as chat-template messages: a user turn's tool results become tool
    turns (before its text and images, whose order is kept), an assistant turn's tool_use blocks its
    tool_calls; image blocks are read into `images` (a 400 without)."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": text_content(req.system, "system", "system", ("text",))})
    for index, message in enumerate(req.messages):
        where = f"messages[{index}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        parts, calls = [], []
        for number, block in enumerate(message.content):
            kind, at = block.get("type"), f"{where}[{number}]"
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and message.role == "user" and images is not None:
                parts.append(images.read(block, at))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": string_field(block, "id", at, "messages"), "type": "function", "function": {
                    "name": string_field(block, "name", at, "messages"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and message.role == "user":
                result = text_content(block.get("content", ""), f"{at}.content", "messages", ("text",))
                messages.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at, "messages"),
                                 "content": result})
            elif kind not in ("thinking", "redacted_thinking"):
                raise ApiError(400, f"{at}: {kind!r} blocks are not supported in a {message.role} turn "
                                    "(text and image, tool_use from the assistant, tool_result from the user)",
                               "messages")
        if parts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": parts or ""}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    return messages
