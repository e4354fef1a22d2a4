"""Reading the loosely typed parts of the Responses and Anthropic request bodies (their input items and
content blocks are decoded as objects): a string field, and text given as a string or as text and
image parts. Each problem is a 400 naming where it is and the body field it belongs to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from crane_mp.frontend.web.errors import ApiError


def string_field(item: dict[str, Any], key: str, where: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param)
    return value


@dataclass(slots=True)
class ImageParts:
    """An API's image parts: the part types that hold one and how its URL (a data: URL for inline bytes)
    is read from a part; collects each image's (where, URL) in prompt order. The chat template sees an
    image as {"type": "image"} (with its URL under "url", so a stored conversation keeps it)."""

    types: tuple[str, ...]
    url_of: Callable[[dict[str, Any], str], str]
    found: list[tuple[str, str]] = field(default_factory=list)

    def read(self, part: dict[str, Any], where: str) -> dict[str, str]:
        url = self.url_of(part, where)
        self.found.append((where, url))
        return {"type": "image", "url": url}


def text_content(content: Any, where: str, param: str, part_types: tuple[str, ...],
                 images: ImageParts | None = None) -> str | list[dict[str, str]]:
    """A string, or text parts (`{"type": one of part_types, "text": ...}`) as chat-template text parts
    (`{"type": "text", "text": ...}`), which the renderer gives the template as it reads them; with
    `images`, image parts among them too."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if images is not None and kind in images.types:
            parts.append(images.read(part, f"{where}[{index}]"))
            continue
        if not isinstance(part, dict) or kind not in part_types or not isinstance(part.get("text"), str):
            allowed = "text and image parts are" if images is not None else "only text parts are"
            raise ApiError(400, f"{where}[{index}]: {allowed} supported, not {kind!r}", param)
        parts.append({"type": "text", "text": part["text"]})
    return parts


def stored_images(messages: list[dict[str, Any]], where: str) -> list[tuple[str, str]]:
    """The images of chat-template messages kept from an earlier request (ImageParts' parts), in order."""
    return [(where, part["url"]) for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if part.get("type") == "image" and "url" in part]
