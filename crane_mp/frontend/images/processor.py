"""An image part's bytes decoded within the pixel budget, turned into the model's patches by its own
(transformers) image processor, and its placeholder token repeated once per merged patch.

Imports neither torch nor transformers at module level: the processor is loaded once, at start-up.
Every bad image is a 400 naming where it is in the request, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFile

from crane_mp.frontend.web.errors import ApiError
from crane_mp.media_settings import pixel_settings_problem

_PARAM = "messages"
# Web image formats only: PIL's other plugins include EPS, which runs Ghostscript on the data. (A phone's
# multi-picture JPEG opens through "JPEG" too.)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(slots=True, frozen=True)
class ImageInput:
    """One image as the vision tower takes it: `pixel_values` [t * h * w patches, C * T * P * P] float32,
    `grid_thw` its (t, h, w) patch grid, `num_tokens` the placeholders it fills (t * h * w / merge**2),
    `key` a hex digest of values and grid that keeps prefix-cache entries of different images apart."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int
    key: str


def image_bytes_from_data_url(url: str, where: str) -> bytes:
    """The bytes of a `data:image/<type>;base64,<data>` URL (whitespace in the data is ignored)."""
    header, comma, payload = url.partition(",")
    media_type, *params = header.removeprefix("data:").split(";")
    if not header.startswith("data:") or not comma or "base64" not in params:
        raise ApiError(400, f"{where}: an image data URL must read data:image/<type>;base64,<data>", _PARAM)
    if not media_type.lower().startswith("image/"):
        raise ApiError(400, f"{where}: the data URL holds {media_type or 'no media type'!r}, not an image", _PARAM)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"{where}: the image data URL is not valid base64 ({err})", _PARAM) from err
    if not data:
        raise ApiError(400, f"{where}: the image data URL holds no data", _PARAM)
    return data


def open_image(data: bytes, max_pixels: int, where: str) -> Image.Image:
    """The image decoded as RGB, transparency composited onto white as transformers' convert_to_rgb does.

    Its size is read from the header and refused above `max_pixels` before any pixel is decoded; a file
    that is not an image, or is truncated or corrupt, is refused too."""
    image = _open(data, where)
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(where, f"{width}x{height} = {width * height} pixels", max_pixels)
    if width == 0 or height == 0:
        raise ApiError(400, f"{where}: the image is empty ({width}x{height})", _PARAM)
    # A global other code may have set: with it, a truncated file would load padded with grey.
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        image.verify()  # PNG: every chunk present with a good CRC (decoding alone forgives a lost tail)
        image = Image.open(io.BytesIO(data), formats=_FORMATS)  # verify() leaves the image unusable
        image.load()
    # Decoders of untrusted bytes fail in many ways (OSError, SyntaxError, ValueError, EOFError, ...).
    except Exception as err:
        raise ApiError(400, f"{where}: the {image.format} image is truncated or corrupt ({err})", _PARAM) from err
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _open(data: bytes, where: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=_FORMATS)  # reads the header only
    # PIL's own limit, when --max-image-pixels is above it (its warning, where warnings are errors).
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _too_many_pixels(where, "larger than PIL decodes", None) from err
    except Exception as err:
        raise ApiError(400, f"{where}: not an image this server reads ({', '.join(_FORMATS)}), or a damaged "
                            f"one: {err}", _PARAM) from err


def _too_many_pixels(where: str, size: str, max_pixels: int | None) -> ApiError:
    limit = f" (the limit is {max_pixels}, set by --max-image-pixels)" if max_pixels is not None else ""
    return ApiError(400, f"{where}: the image is too large: {size}{limit}", _PARAM)


def preprocess_image(image: Image.Image, processor: Any, where: str = "an image",
                     settings: dict[str, Any] | None = None) -> ImageInput:
    """`image` through transformers' image processor of the checkpoint (the one AutoProcessor holds),
    so the patches equal what the processor gives transformers' own generate; `settings`: the call's
    arguments (ImageProcessor.settings). An image the processor refuses (Qwen2-VL's: an aspect ratio
    over 200) is a 400 naming `where`."""
    try:
        out = processor(images=[image], return_tensors="np", **(settings or {}))
    except ValueError as err:
        raise ApiError(400, f"{where}: the model's image processor refuses the image ({err})", _PARAM) from err
    pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)  # [patches, C * T * P * P]
    t, h, w = (int(n) for n in out["image_grid_thw"][0])
    digest = hashlib.sha256(pixel_values.tobytes())
    digest.update(np.array([t, h, w], dtype=np.int64).tobytes())
    return ImageInput(pixel_values, (t, h, w), t * h * w // processor.merge_size**2, digest.hexdigest())


@dataclass(slots=True)
class ImageProcessor:
    """The served model's image processor, the placeholder token its images fill, and the pixel bounds it
    resizes images to (its preprocessor_config's, or --mm-processor-kwargs'; None: it has none)."""

    processor: Any  # transformers' image processor (Qwen2VLImageProcessor or its PIL twin)
    image_token_id: int
    min_pixels: int | None = None
    max_pixels: int | None = None

    def settings(self, kwargs: dict[str, Any] | None, param: str = "mm_processor_kwargs") -> dict[str, Any]:
        """The processor call's arguments for a request's mm_processor_kwargs (None: the server's bounds).
        A request may shrink the bounds, not raise max_pixels above the server's: the memory plan holds
        the server's largest image."""
        if kwargs is None:
            return self._size(self.min_pixels, self.max_pixels)
        problem = pixel_settings_problem(kwargs)
        if problem is not None:
            raise ApiError(400, f"{param}: {problem}", param)
        if self.max_pixels is None:
            raise ApiError(400, f"{param}: this model's image processor takes no pixel bounds", param)
        high = kwargs.get("max_pixels", self.max_pixels)
        if high > self.max_pixels:
            raise ApiError(400, f"{param}.max_pixels {high} is above this server's {self.max_pixels} "
                                "(--mm-processor-kwargs)", param)
        low = kwargs.get("min_pixels", min(self.min_pixels or high, high))
        if low > high:
            raise ApiError(400, f"{param}: min_pixels {low} is above max_pixels {high}", param)
        return self._size(low, high)

    @staticmethod
    def _size(low: int | None, high: int | None) -> dict[str, Any]:
        return {} if high is None else {"size": {"shortest_edge": low, "longest_edge": high}}

    def preprocess(self, image: Image.Image, where: str = "an image",
                   settings: dict[str, Any] | None = None) -> ImageInput:
        return preprocess_image(image, self.processor, where, self.settings(None) if settings is None else settings)


def load_image_processor(model_dir: Path, overrides: dict[str, int] | None = None) -> ImageProcessor:
    """From the checkpoint: preprocessor_config.json through AutoImageProcessor, with the backend
    AutoProcessor would pick (so the pixels match it), and config.json's image_token_id; `overrides`
    (--mm-processor-kwargs) set the server's pixel bounds."""
    from transformers import AutoImageProcessor

    config = json.loads((model_dir / "config.json").read_text())
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    size = getattr(processor, "size", None)
    low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    overrides = overrides or {}
    if overrides and high is None:
        raise ValueError(f"--mm-processor-kwargs: {type(processor).__name__} takes no pixel bounds")
    low, high = overrides.get("min_pixels", low), overrides.get("max_pixels", high)
    if low is not None and high is not None and low > high:
        raise ValueError(f"--mm-processor-kwargs: min_pixels {low} is above max_pixels {high}")
    return ImageProcessor(processor, int(config["image_token_id"]), low, high)


def expand_image_tokens(token_ids: list[int], image_token_id: int,
                        counts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt with its i-th `image_token_id` repeated counts[i] times, as the processor expands the
    rendered template, and each image's (offset, count) in the expanded prompt.

        in:   ... <vs> <pad> <ve> ... <vs> <pad> <ve> ...
        out:  ... <vs> <pad> x counts[0] <ve> ... <vs> <pad> x counts[1] <ve> ...
                       ^ offset 0                      ^ offset 1
    """
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(counts):
        raise ValueError(f"{len(positions)} image placeholders for {len(counts)} images")
    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    start = 0
    for position, count in zip(positions, counts):
        expanded += token_ids[start:position]
        spans.append((len(expanded), count))
        expanded += [image_token_id] * count
        start = position + 1
    expanded += token_ids[start:]
    return expanded, spans
