"""multipart/form-data bodies (file uploads, as OpenAI's audio routes take them) decoded into a Struct.

Form values arrive as text; msgspec converts them to the Struct's types (numbers, booleans) with the
same 400s a JSON body gets. A field named `name[]` (how the openai SDK sends a list) fills the list
`name`. The body is read within --read-timeout and the request's size limit, parts counted together.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web

from crane_mp.frontend.web.errors import ApiError


async def read_form(request: web.Request, form: type, timeout: float, limit: int) -> Any:
    """The body as a `form` Struct; `limit`: its bytes (--max-request-bytes)."""
    try:
        async with asyncio.timeout(timeout):
            fields = await _read_parts(request, limit)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--read-timeout)") from None
    except ValueError as err:  # aiohttp's malformed multipart
        raise ApiError(400, f"malformed multipart body: {err}") from None
    try:
        return msgspec.convert(fields, form, strict=False)
    except msgspec.ValidationError as err:
        message = str(err)
        param = message.rsplit("`$.", 1)[-1].rstrip("`").split("[")[0] if "`$." in message else None
        raise ApiError(400, message, param) from None


async def _read_parts(request: web.Request, limit: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    total = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or not part.name:
            raise ApiError(400, "every part of the form must be a named field")
        value = bytearray()
        while chunk := await part.read_chunk():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)")
            value += chunk
        if part.filename is None:
            try:
                value = value.decode(part.get_charset("utf-8"))
            except (UnicodeDecodeError, LookupError):
                raise ApiError(400, f"form field {part.name!r} is not text", part.name) from None
        else:
            value = bytes(value)
        name = part.name
        if name.endswith("[]"):
            fields.setdefault(name[:-2], []).append(value)
        else:
            fields[name] = value
    return fields
