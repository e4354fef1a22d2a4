"""Images of a chat request: counted, fetched (data: URLs, or http(s) from an allowed host, fetch.py),
decoded within the pixel budget, run through the model's image processor, and placed at their
placeholder tokens.

Decoding and processing run in a worker thread (PIL and numpy release the GIL for the heavy parts), so
the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
from typing import Any

from crane_mp.frontend.images.data_url import data_url_bytes
from crane_mp.frontend.images.fetch import fetch_image
from crane_mp.frontend.images.processor import ImageInput, expand_image_tokens, open_image
from crane_mp.frontend.images.video import VideoInput, VideoLimits, decode_video, preprocess_video
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.access_log import current_record
from crane_mp.frontend.web.errors import ApiError
from crane_mp.protocol import MediaInput


def check_takes_images(state: FrontendState, count: int, param: str = "messages") -> None:
    """The model takes `count` images in one request; checked before any is fetched or decoded, which all
    run at once and before the prompt's length is known."""
    if count and state.image_processor is None:
        raise ApiError(400, f"model {state.model_name!r} takes no images; send text only", param)
    limit = state.config.max_images_per_request
    if count > limit:
        raise ApiError(400, f"the request holds {count} images; this server takes at most {limit} "
                            "(--max-images-per-request)", param)


async def load_images(state: FrontendState, urls: list[tuple[str, str]],
                      settings: dict[str, Any] | None = None) -> list[ImageInput]:
    """Each (where, url) decoded and processed (with `settings`: ImageProcessor.settings), in order; a
    bad one is a 400 naming where it is."""
    return list(await asyncio.gather(*(_load(state, where, url, settings) for where, url in urls)))


async def _load(state: FrontendState, where: str, url: str, settings: dict[str, Any] | None) -> ImageInput:
    if url.startswith("data:"):
        data = data_url_bytes(url, where, "image")
    else:
        data = await fetch_image(state.config, where, url, state.max_request_bytes)
    processor, limit = state.image_processor, state.config.max_image_pixels
    return await asyncio.to_thread(lambda: processor.preprocess(open_image(data, limit, where), where, settings))


def check_takes_videos(state: FrontendState, count: int) -> None:
    if count and (state.image_processor is None or state.image_processor.video is None):
        raise ApiError(400, f"model {state.model_name!r} takes no videos", "messages")
    limit = state.config.max_images_per_request
    if count > limit:
        raise ApiError(400, f"the request holds {count} videos; this server takes at most {limit} "
                            "(--max-images-per-request)", "messages")


async def load_videos(state: FrontendState, urls: list[tuple[str, str]]) -> list[VideoInput]:
    """Each (where, url) decoded, its frames sampled and processed, in order; a bad one is a 400 naming
    where it is."""
    return list(await asyncio.gather(*(_load_video(state, where, url) for where, url in urls)))


async def _load_video(state: FrontendState, where: str, url: str) -> VideoInput:
    if url.startswith("data:"):
        data = data_url_bytes(url, where, "video")
    else:
        data = await fetch_image(state.config, where, url, state.max_request_bytes)
    config, settings = state.config, state.image_processor.video
    limits = VideoLimits(config.max_video_seconds, config.max_video_frames, config.max_image_pixels)

    def process() -> VideoInput:
        return preprocess_video(*decode_video(data, settings, limits, where), settings, where)

    return await asyncio.to_thread(process)


def record_images(state: FrontendState, count: int) -> None:
    """The request's images (and videos) in its access-log line and the metrics."""
    record = current_record()
    if record is not None:
        record.images += count
    state.metrics.media_received(images=count)


def place_images(state: FrontendState, ids: list[int], images: list[ImageInput],
                 param: str = "messages") -> tuple[list[int], list[MediaInput]]:
    """The prompt with each image's one placeholder repeated for its patches (Gemma 3: replaced by the
    tokens of its expansion), and the images as the engine takes them."""
    processor = state.image_processor
    if processor.expands_text:
        expanded = processor.splice(ids, images, param)
        return expanded, processor.crop_media(expanded, images, param)
    token = processor.image_token_id
    if ids.count(token) != len(images):
        why = ("message text may not contain the image token" if param == "messages" else
               f"the prompt needs one {state.tokenizer.decode([token], skip_special_tokens=False)!r} per image, "
               "where the image goes")
        raise ApiError(400, f"the prompt holds {ids.count(token)} image placeholders for {len(images)} images: "
                            f"{why}", param)
    expanded, spans = expand_image_tokens(ids, token, [image.num_tokens for image in images])
    media = [MediaInput("image", image.key, list(image.pixel_values.shape), image.pixel_values.tobytes(), offset,
                        count, list(image.grid_thw)) for image, (offset, count) in zip(images, spans)]
    return expanded, media
