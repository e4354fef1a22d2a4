"""Images of a chat request: fetched (data: URLs, or http(s) from an allowed host), decoded within the
pixel budget, run through the model's image processor, and placed at their placeholder tokens.

Decoding and processing run in a worker thread (PIL and numpy release the GIL for the heavy parts), so
the event loop keeps serving. The frontend fetches a URL only when --allowed-media-domains names its
host; redirects are not followed (one could lead anywhere).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from crane_mp.frontend.access_log import current_record
from crane_mp.frontend.errors import ApiError
from crane_mp.frontend.images import ImageInput, expand_image_tokens, image_bytes_from_data_url, open_image
from crane_mp.frontend.state import FrontendState
from crane_mp.protocol import MediaInput

_FETCH_SECONDS = 10.0


def check_takes_images(state: FrontendState, count: int) -> None:
    if count and state.image_processor is None:
        raise ApiError(400, f"model {state.model_name!r} takes no images; send text parts only", "messages")


async def load_images(state: FrontendState, urls: list[tuple[str, str]]) -> list[ImageInput]:
    """Each (where, url) decoded and processed, in order; a bad one is a 400 naming where it is."""
    return list(await asyncio.gather(*(_load(state, where, url) for where, url in urls)))


async def _load(state: FrontendState, where: str, url: str) -> ImageInput:
    if url.startswith("data:"):
        data = image_bytes_from_data_url(url, where)
    else:
        data = await _fetch(state, where, url)
    processor, limit = state.image_processor, state.config.max_image_pixels
    return await asyncio.to_thread(lambda: processor.preprocess(open_image(data, limit, where), where))


def _allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in domains))


async def _fetch(state: FrontendState, where: str, url: str) -> bytes:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiError(400, f"{where}: an image URL must be a data: URL or http(s)", "messages")
    if not _allowed(parts.hostname, state.config.allowed_media_domains):
        raise ApiError(400, f"{where}: images are not fetched from {parts.hostname!r}; send a data: URL, or "
                            "start the server with --allowed-media-domains naming the host", "messages")
    limit = state.max_request_bytes
    try:
        timeout = aiohttp.ClientTimeout(total=_FETCH_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ApiError(400, f"{where}: fetching the image answered HTTP {response.status}", "messages")
                data = await response.content.read(limit + 1)
    except (aiohttp.ClientError, TimeoutError) as err:
        raise ApiError(400, f"{where}: the image could not be fetched ({type(err).__name__})", "messages") from err
    if len(data) > limit:
        raise ApiError(400, f"{where}: the image is larger than {limit} bytes", "messages")
    return data


def record_images(state: FrontendState, count: int) -> None:
    """The request's images in its access-log line and the metrics."""
    record = current_record()
    if record is not None:
        record.images += count
    state.metrics.media_received(images=count)


def place_images(state: FrontendState, ids: list[int], images: list[ImageInput]) -> tuple[list[int], list[MediaInput]]:
    """The prompt with each image's one placeholder repeated for its patches, and the images as the
    engine takes them."""
    token = state.image_processor.image_token_id
    if ids.count(token) != len(images):
        raise ApiError(400, f"the prompt holds {ids.count(token)} image placeholders for {len(images)} images: "
                            "message text may not contain the image token", "messages")
    expanded, spans = expand_image_tokens(ids, token, [image.num_tokens for image in images])
    media = [MediaInput("image", image.key, list(image.pixel_values.shape), image.pixel_values.tobytes(), offset,
                        count, list(image.grid_thw)) for image, (offset, count) in zip(images, spans)]
    return expanded, media
