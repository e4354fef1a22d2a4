"""Reading the loosely typed parts of the Responses and Anthropic request bodies (their input items and
content blocks are decoded as objects): a string field, and text given as a string or as text parts.
Each problem is a 400 naming where it is and the body field it belongs to."""

from __future__ import annotations

from typing import Any

from crane_mp.frontend.web.errors import ApiError


def string_field(item: dict[str, Any], key: str, where: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param)
    return value


def text_content(content: Any, where: str, param: str, part_types: tuple[str, ...]) -> str | list[dict[str, str]]:
    """A string, or text parts (`{"type": one of part_types, "text": ...}`) as chat-template text parts
    (`{"type": "text", "text": ...}`), which the renderer gives the template as it reads them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param)
    parts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}[{index}]: only text parts are supported, not {kind!r}", param)
        parts.append({"type": "text", "text": part["text"]})
    return parts
