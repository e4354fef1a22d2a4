"""An image part's bytes decoded within the pixel budget, turned into the model's patches by its own
(transformers) image processor, and its placeholder token repeated once per merged patch.

Imports neither torch nor transformers at module level: the processor is loaded once, at start-up.
Every bad image is a 400 naming where it is in the request, never a 500.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFile

from crane_mp.frontend.images.video import VideoInput, VideoSettings, video_text
from crane_mp.frontend.web.errors import ApiError
from crane_mp.media_settings import pixel_settings_problem
from crane_mp.protocol import MediaInput

_PARAM = "messages"
# Qwen3VLProcessor's placeholders, and the checkpoints whose processor it is (they take videos).
_IMAGE_PAD, _VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
_VISION_START, _VISION_END = "<|vision_start|>", "<|vision_end|>"
_VIDEO_MODEL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
# Web image formats only: PIL's other plugins include EPS, which runs Ghostscript on the data. (A phone's
# multi-picture JPEG opens through "JPEG" too.)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(slots=True, frozen=True)
class ImageInput:
    """One image as the vision tower takes it: `pixel_values` [t * h * w patches, C * T * P * P] float32,
    `grid_thw` its (t, h, w) patch grid, `num_tokens` the placeholders it fills (t * h * w / merge**2),
    `key` a hex digest of values and grid that keeps prefix-cache entries of different images apart.
    Gemma 3's: `pixel_values` [1 + num_crops, C, H, W], the whole image then its pan-and-scan crops,
    each filling its own run of soft tokens."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int
    key: str
    num_crops: int = 0


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
                     settings: dict[str, Any] | None = None, tokens_per_image: int = 0) -> ImageInput:
    """`image` through transformers' image processor of the checkpoint (the one AutoProcessor holds),
    so the pixels equal what the processor gives transformers' own generate; `settings`: the call's
    arguments (ImageProcessor.settings); `tokens_per_image`: Gemma 3's soft tokens per image or crop.
    An image the processor refuses (Qwen2-VL's: an aspect ratio over 200) is a 400 naming `where`."""
    try:
        out = processor(images=[image], return_tensors="np", **(settings or {}))
    except ValueError as err:
        raise ApiError(400, f"{where}: the model's image processor refuses the image ({err})", _PARAM) from err
    pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    if "num_crops" in out:  # Gemma 3: [1 + crops, C, H, W], every one of tokens_per_image soft tokens
        crops, grid = int(out["num_crops"][0]), (1, *pixel_values.shape[-2:])  # its grid: the pixels'
        num_tokens = tokens_per_image * (1 + crops)
    else:  # [patches, C * T * P * P]
        crops, grid = 0, tuple(int(n) for n in out["image_grid_thw"][0])
        num_tokens = math.prod(grid) // processor.merge_size**2
    digest = hashlib.sha256(pixel_values.tobytes())
    digest.update(np.array(grid, dtype=np.int64).tobytes())
    return ImageInput(pixel_values, grid, num_tokens, digest.hexdigest(), crops)


@dataclass(slots=True)
class ImageProcessor:
    """The served model's image processor, the placeholder token its images fill, and the pixel bounds it
    resizes images to (its preprocessor_config's, or --mm-processor-kwargs'; None: it has none).
    Gemma 3's (`text_processor`, transformers' Gemma3Processor) expands each image's placeholder in the
    prompt's text into its soft tokens, as that processor does, and sizes every image to one square."""

    processor: Any  # transformers' image processor (Qwen2VLImageProcessor or its PIL twin, Gemma's)
    image_token_id: int
    min_pixels: int | None = None
    max_pixels: int | None = None
    text_processor: Any = None
    tokens_per_image: int = 0
    video: VideoSettings | None = None  # Qwen3-VL's and Qwen3.5's: they take videos too
    video_token_id: int | None = None

    def settings(self, kwargs: dict[str, Any] | None, param: str = "mm_processor_kwargs") -> dict[str, Any]:
        """The processor call's arguments for a request's mm_processor_kwargs (None: the server's bounds).
        A request may shrink the bounds, not raise max_pixels above the server's: the memory plan holds
        the server's largest image. Gemma 3's take do_pan_and_scan (a boolean) instead."""
        if self.text_processor is not None:
            return _pan_and_scan(kwargs, param)
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
        return preprocess_image(image, self.processor, where, self.settings(None) if settings is None else settings,
                                self.tokens_per_image)

    @property
    def expands_text(self) -> bool:
        return self.text_processor is not None

    def expand_text(self, text: str, images: list[ImageInput], param: str = "messages") -> str:
        """Gemma 3: the prompt with its i-th image placeholder (<start_of_image>) replaced as the processor
        replaces it: the image's soft tokens between its start and end tokens (and its crops')."""
        placeholder = self.text_processor.boi_token
        pieces = text.split(placeholder)
        if len(pieces) - 1 != len(images):
            raise ApiError(400, f"the prompt holds {len(pieces) - 1} image placeholders ({placeholder}) for "
                                f"{len(images)} images: message text may not contain them", param)
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:]):
            out += [self.text_processor.replace_image_token({"num_crops": [image.num_crops]}, 0), piece]
        return "".join(out)

    def splice(self, ids: list[int], images: list[ImageInput], param: str) -> list[int]:
        """Gemma 3, for a prompt given as tokens: each placeholder token replaced by the tokens of its
        expansion (expand_text's text, tokenized alone)."""
        tokenizer = self.text_processor.tokenizer
        placeholder = tokenizer.convert_tokens_to_ids(self.text_processor.boi_token)
        if ids.count(placeholder) != len(images):
            raise ApiError(400, f"the prompt holds {ids.count(placeholder)} image placeholders for {len(images)} "
                                f"images: it needs one {self.text_processor.boi_token!r} per image", param)
        out: list[int] = []
        images_left = iter(images)
        for token in ids:
            if token != placeholder:
                out.append(token)
                continue
            expansion = self.text_processor.replace_image_token({"num_crops": [next(images_left).num_crops]}, 0)
            out += tokenizer(expansion, add_special_tokens=False)["input_ids"]
        return out

    def crop_media(self, ids: list[int], images: list[ImageInput], param: str = "messages") -> list[MediaInput]:
        """Gemma 3: each image and crop as the engine takes it, at its run of soft tokens, the runs found
        in order in the expanded prompt."""
        runs = _runs(ids, self.image_token_id)
        parts = [(f"{image.key}:{crop}", image.pixel_values[crop : crop + 1], image.grid_thw)
                 for image in images for crop in range(1 + image.num_crops)]
        if len(runs) != len(parts) or any(count != self.tokens_per_image for _, count in runs):
            raise ApiError(400, f"the prompt's image soft tokens ({sum(c for _, c in runs)}) are not the {len(images)} "
                                "images': message text may not contain the image token", param)
        return [MediaInput("image", key, list(values.shape), values.tobytes(), offset, count, list(grid))
                for (key, values, grid), (offset, count) in zip(parts, runs)]


    def expand_videos(self, text: str, images: list[ImageInput], videos: list[VideoInput]) -> str:
        """Qwen3-VL / Qwen3.5 with videos: the prompt with each image's placeholder repeated for its
        patches and each video's written as Qwen3VLProcessor writes it (video.py's video_text)."""
        pieces = iter(text.split(_IMAGE_PAD))
        if text.count(_IMAGE_PAD) != len(images) or text.count(_VIDEO_PAD) != len(videos):
            raise ApiError(400, f"the prompt holds {text.count(_IMAGE_PAD)} image and {text.count(_VIDEO_PAD)} video "
                                f"placeholders for {len(images)} images and {len(videos)} videos: message text may "
                                "not contain them", _PARAM)
        out = [next(pieces)]
        for image, piece in zip(images, pieces):
            out += [_IMAGE_PAD * image.num_tokens, piece]
        pieces = iter("".join(out).split(_VIDEO_PAD))
        out = [next(pieces)]
        for video, piece in zip(videos, pieces):
            out += [video_text(video, self.video.merge_size, _VISION_START, _VIDEO_PAD, _VISION_END), piece]
        return "".join(out)

    def video_media(self, ids: list[int], images: list[ImageInput], videos: list[VideoInput]) -> list[MediaInput]:
        """The images and each video's frame pairs as the engine takes them (a frame pair as an image of
        one temporal patch: the tower attends within each anyway), at their runs of placeholders, in
        prompt order."""
        image_runs, frame_runs = _runs(ids, self.image_token_id), _runs(ids, self.video_token_id)
        frames = [(video, t) for video in videos for t in range(video.grid_thw[0])]
        frame_tokens = [video.frame_tokens(self.video.merge_size) for video, _ in frames]
        if [count for _, count in image_runs] != [image.num_tokens for image in images] or \
                [count for _, count in frame_runs] != frame_tokens:
            raise ApiError(400, "the prompt's image and video placeholders are not its images' and videos': message "
                                "text may not contain them", _PARAM)
        media = [MediaInput("image", image.key, list(image.pixel_values.shape), image.pixel_values.tobytes(), offset,
                            count, list(image.grid_thw)) for image, (offset, count) in zip(images, image_runs)]
        for (video, t), (offset, count) in zip(frames, frame_runs):
            _, height, width = video.grid_thw
            values = video.pixel_values[t * height * width : (t + 1) * height * width]
            media.append(MediaInput("image", f"{video.key}:{t}", list(values.shape), values.tobytes(), offset, count,
                                    [1, height, width]))
        return sorted(media, key=lambda item: item.offset)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for position, value in enumerate(ids):
        if value != token:
            continue
        if runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def _pan_and_scan(kwargs: dict[str, Any] | None, param: str) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"do_pan_and_scan"} or not isinstance(
            kwargs.get("do_pan_and_scan", False), bool):
        raise ApiError(400, f"{param}: this model's image processor takes do_pan_and_scan (true or false)", param)
    return dict(kwargs)


def load_image_processor(model_dir: Path, overrides: dict[str, int] | None = None) -> ImageProcessor:
    """From the checkpoint: preprocessor_config.json through AutoImageProcessor, with the backend
    AutoProcessor would pick (so the pixels match it), and config.json's image_token_id; `overrides`
    (--mm-processor-kwargs) set the server's pixel bounds. Gemma 3's whole processor (AutoProcessor)."""
    from transformers import AutoImageProcessor, AutoProcessor

    config = json.loads((model_dir / "config.json").read_text())
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    if config.get("model_type") == "gemma3":
        if overrides:
            raise ValueError("--mm-processor-kwargs: Gemma 3's processor sizes every image to one square")
        text_processor = AutoProcessor.from_pretrained(str(model_dir))
        token = config.get("image_token_index", config.get("image_token_id"))
        return ImageProcessor(text_processor.image_processor, int(token), text_processor=text_processor,
                              tokens_per_image=int(text_processor.image_seq_length))
    size = getattr(processor, "size", None)
    low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    video = VideoSettings.of_checkpoint(model_dir) if config.get("model_type") in _VIDEO_MODEL_TYPES else None
    overrides = overrides or {}
    if overrides and high is None:
        raise ValueError(f"--mm-processor-kwargs: {type(processor).__name__} takes no pixel bounds")
    low, high = overrides.get("min_pixels", low), overrides.get("max_pixels", high)
    if low is not None and high is not None and low > high:
        raise ValueError(f"--mm-processor-kwargs: min_pixels {low} is above max_pixels {high}")
    return ImageProcessor(processor, int(config["image_token_id"]), low, high, video=video,
                          video_token_id=config.get("video_token_id"))


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
