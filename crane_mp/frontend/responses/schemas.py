"""The OpenAI Responses API's request body (/v1/responses) as msgspec Structs. Fields this server does
not act on (truncation, service_tier, prompt_cache_key, ...) are accepted and ignored, as agent clients
send them, and so are `include` entries but the text's logprobs; tools other than functions, and input
that is not text, are a 400.

`input` items differ by shape (a message may omit its type), so they are decoded as objects and read
by `input_messages`; INPUT_SCHEMA states the item shapes for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from crane_mp.frontend.openai.schemas import FunctionName, arguments_object
from crane_mp.frontend.serving.message_parts import ImageParts, string_field, text_content
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.fields import PositiveCount, Temperature, TopLogprobs, TopP


class ResponseFormatConfig(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None  # json_schema: none is any JSON object
    strict: bool | None = None


class ResponseTextConfig(msgspec.Struct, kw_only=True):
    format: ResponseFormatConfig | None = None
    verbosity: str | None = None


class ResponseFunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedFunction(msgspec.Struct):
    type: Literal["function"]
    name: str


class ResponseReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


TEXT_LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the text's logprobs


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: Annotated[list[ResponseFunctionTool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedFunction | None = None
    parallel_tool_calls: bool = True
    text: ResponseTextConfig | None = None
    reasoning: ResponseReasoningConfig | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: Annotated[list[str], msgspec.Meta(max_length=32)] | None = None
    stream: bool | None = False  # null: false (sglang-router forwards it so)
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @property
    def logprobs(self) -> int | None:
        """How many alternatives each output_text token lists with its logprob; None: no logprobs. OpenAI
        sends them where `include` names them; top_logprobs alone asks for them too."""
        if self.top_logprobs is None and TEXT_LOGPROBS not in (self.include or ()):
            return None
        return self.top_logprobs or 0


_PART_TYPES = ("input_text", "output_text", "text")
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": list(_PART_TYPES)}, "text": {"type": "string"}}}
_IMAGE_PART = {"type": "object", "required": ["type", "image_url"], "properties": {
    "type": {"const": "input_image"}, "image_url": {"type": "string", "description": "an http(s) or data: URL"},
    "detail": {"enum": ["auto", "low", "high"]}}}
_READ_ITEMS = [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
        "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}},
]
# The input item shapes input_messages reads (for /openapi.json): messages with text, the function
# calls of an earlier answer and their outputs, and reasoning items (skipped: thinking is not fed
# back), at least one of them not reasoning.
INPUT_SCHEMA = {"anyOf": [{"type": "string"}, {
    "type": "array", "minItems": 1, "contains": {"anyOf": _READ_ITEMS},
    "items": {"anyOf": [*_READ_ITEMS, {"type": "object", "required": ["type"],
                                       "properties": {"type": {"const": "reasoning"}}}]}}]}


def input_image_url(part: dict[str, Any], where: str) -> str:
    """An input_image part's URL (detail is accepted: the model's processor sizes every image)."""
    url = part.get("image_url")
    if isinstance(url, dict):  # the chat API's spelling, as some clients send it here too
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: an input_image needs image_url (an http(s) or data: URL); file_id is not "
                            "supported", "input")
    return url


def input_messages(value: str | list[dict[str, Any]], images: ImageParts | None = None) -> list[dict[str, Any]]:
    """`input` as chat-template messages: consecutive function calls become one assistant turn's
    tool_calls, their outputs tool turns; input_image parts are read into `images`. A 400 names the
    item that cannot be read."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", "input")
            content = text_content(item.get("content"), f"{where}.content", "input", _PART_TYPES, images)
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where, "input"), "type": "function",
                    "function": {"name": string_field(item, "name", where, "input"),
                                 "arguments": arguments_object(string_field(item, "arguments", where, "input"))}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": string_field(item, "call_id", where, "input"),
                             "content": text_content(item.get("output"), f"{where}.output", "input", _PART_TYPES)})
        elif kind != "reasoning":
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported (messages with text, "
                                "function_call, function_call_output and reasoning are)", "input")
    return messages
