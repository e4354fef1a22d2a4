"""The bytes of a base64 data URL of an image or a video part; a 400 naming the part otherwise."""

from __future__ import annotations

import base64
import binascii

from crane_mp.frontend.web.errors import ApiError

_PARAM = "messages"
_ARTICLE = {"image": "an", "video": "a"}


def data_url_bytes(url: str, where: str, kind: str) -> bytes:
    """The bytes of a `data:<kind>/<type>;base64,<data>` URL (whitespace in the data is ignored);
    `kind` is "image" or "video"."""
    header, comma, payload = url.partition(",")
    media_type, *params = header.removeprefix("data:").split(";")
    if not header.startswith("data:") or not comma or "base64" not in params:
        raise ApiError(400, f"{where}: {_ARTICLE[kind]} {kind} data URL must read data:{kind}/<type>;base64,<data>",
                       _PARAM)
    if not media_type.lower().startswith(f"{kind}/"):
        raise ApiError(400, f"{where}: the data URL holds {media_type or 'no media type'!r}, not {_ARTICLE[kind]} "
                            f"{kind}", _PARAM)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"{where}: the {kind} data URL is not valid base64 ({err})", _PARAM) from err
    if not data:
        raise ApiError(400, f"{where}: the {kind} data URL holds no data", _PARAM)
    return data
