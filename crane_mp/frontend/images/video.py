"""Videos for Qwen3-VL and Qwen3.5: decoded with PyAV (its wheels bundle FFmpeg: no system codecs),
frames sampled, resized and cut into patches by the rules of transformers' Qwen3VLVideoProcessor, and
each pair of frames written into the prompt as Qwen3VLProcessor writes it: its timestamp, then its own
run of video placeholders between vision start and end tokens.

transformers' video processor needs torchvision, which does not install beside the pinned torch: its
rules are reimplemented here (frames resized by PIL's bicubic filter, as the image processor's PIL
backend resizes images, then rescaled and normalised). A video's duration and frame size are read from
its header and refused past the server's limits before any frame is decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from crane_mp.frontend.web.errors import ApiError

_PARAM = "messages"


@dataclass(frozen=True, slots=True)
class VideoSettings:
    """Qwen3VLVideoProcessor's settings (its defaults, or the checkpoint's video_preprocessor_config.json)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32  # over all the sampled frames
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def of_checkpoint(cls, model_dir: Path) -> VideoSettings:
        path = model_dir / "video_preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        size = raw.get("size") or {}
        default = cls()
        return cls(
            fps=float(raw.get("fps", default.fps)), min_frames=int(raw.get("min_frames", default.min_frames)),
            max_frames=int(raw.get("max_frames", default.max_frames)),
            min_pixels=int(size.get("shortest_edge", default.min_pixels)),
            max_pixels=int(size.get("longest_edge", default.max_pixels)),
            patch_size=int(raw.get("patch_size", default.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            image_mean=tuple(raw.get("image_mean", default.image_mean)),
            image_std=tuple(raw.get("image_std", default.image_std)))


@dataclass(frozen=True, slots=True)
class VideoInput:
    """A video as the vision tower takes it: `pixel_values` [t * h * w, C * T * P * P] float32, `grid_thw`
    (t frame pairs, h, w patches), each pair's timestamp in seconds, `key` a digest of its values."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    timestamps: list[float]
    key: str

    def frame_tokens(self, merge_size: int) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // merge_size**2


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_seconds: float
    max_frames: int  # sampled frames
    max_pixels: int  # one frame's width x height


def sample_indices(total_frames: int, video_fps: float, settings: VideoSettings) -> np.ndarray:
    """Qwen3VLVideoProcessor.sample_frames: `fps` frames a second, at least min_frames and at most
    max_frames (and the video's), spread evenly over the whole video."""
    count = int(total_frames / video_fps * settings.fps)
    count = min(max(count, settings.min_frames), settings.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def decode_video(data: bytes, settings: VideoSettings, limits: VideoLimits,
                 where: str) -> tuple[list[np.ndarray], np.ndarray, float]:
    """The sampled frames (RGB, [H, W, 3] uint8), their indices and the video's frame rate. Its duration,
    frame count and size come from the header and are checked against `limits` first."""
    import av

    try:
        container = av.open(io.BytesIO(data))
    except Exception as err:  # FFmpeg's demuxers fail in many ways on untrusted bytes
        raise ApiError(400, f"{where}: not a video this server reads ({err})", _PARAM) from err
    with container:
        if not container.streams.video:
            raise ApiError(400, f"{where}: the file holds no video stream", _PARAM)
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        seconds = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                   else (container.duration or 0) / 1e6)
        if fps <= 0 or seconds <= 0:
            raise ApiError(400, f"{where}: the video's header states no frame rate or duration", _PARAM)
        if seconds > limits.max_seconds:
            raise ApiError(400, f"{where}: the video is {seconds:.1f} s long; this server takes at most "
                                f"{limits.max_seconds:g} s (--max-video-seconds)", _PARAM)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_pixels:
            raise ApiError(400, f"{where}: the video's frames are {width}x{height} = {width * height} pixels (the "
                                f"limit is {limits.max_pixels}, set by --max-image-pixels)", _PARAM)
        total = stream.frames or max(1, round(seconds * fps))
        indices = sample_indices(total, fps, settings)
        if len(indices) > limits.max_frames:
            raise ApiError(400, f"{where}: the video samples to {len(indices)} frames; this server takes at most "
                                f"{limits.max_frames} (--max-video-frames)", _PARAM)
        wanted, frames, last = set(indices.tolist()), {}, None
        try:
            for number, frame in enumerate(container.decode(stream)):
                last = frame
                if number in wanted:
                    frames[number] = frame.to_ndarray(format="rgb24")
                if number >= indices[-1]:
                    break
        except Exception as err:
            raise ApiError(400, f"{where}: the video is truncated or corrupt ({err})", _PARAM) from err
    if last is None:
        raise ApiError(400, f"{where}: the video has no frames", _PARAM)
    # A header that overstates the frame count: the sampled indices past the end read the last frame.
    final = last.to_ndarray(format="rgb24")
    return [frames.get(i, final) for i in indices.tolist()], indices, fps


def video_size(num_frames: int, height: int, width: int, settings: VideoSettings) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: each side a multiple of patch x merge, all the sampled frames'
    pixels within [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    factor = settings.patch_size * settings.merge_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    temporal = settings.temporal_patch_size
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt(num_frames * height * width / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_video(frames: list[np.ndarray], indices: np.ndarray, video_fps: float, settings: VideoSettings,
                     where: str = "a video") -> VideoInput:
    """The sampled frames resized, rescaled, normalised and cut into patches (frame pairs, merge blocks
    in raster order), and each pair's timestamp: the mean of its two frames' times."""
    height, width = frames[0].shape[:2]
    try:
        new_height, new_width = video_size(len(frames), height, width, settings)
    except ValueError as err:
        raise ApiError(400, f"{where}: the model's video processor refuses the video ({err})", _PARAM) from err
    mean = np.array(settings.image_mean, dtype=np.float32)[:, None, None]
    std = np.array(settings.image_std, dtype=np.float32)[:, None, None]
    resized = [np.asarray(Image.fromarray(frame).resize((new_width, new_height), Image.BICUBIC), dtype=np.float32)
               for frame in frames]
    video = np.stack([(frame.transpose(2, 0, 1) / 255.0 - mean) / std for frame in resized]).astype(np.float32)
    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    indices = indices.tolist()
    if pad := -len(video) % temporal:  # the last frame repeated to fill the last pair
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        indices += [indices[-1]] * pad
    grid_t, grid_h, grid_w = len(video) // temporal, new_height // patch, new_width // patch
    channels = video.shape[1]
    patches = video.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t * grid_h * grid_w, -1)
    pixel_values = np.ascontiguousarray(patches, dtype=np.float32)
    times = [index / video_fps for index in indices]
    timestamps = [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]
    digest = hashlib.sha256(pixel_values.tobytes())
    digest.update(np.array([grid_t, grid_h, grid_w], dtype=np.int64).tobytes())
    return VideoInput(pixel_values, (grid_t, grid_h, grid_w), timestamps, digest.hexdigest())


def video_text(video: VideoInput, merge_size: int, start: str, pad: str, end: str) -> str:
    """A video's placeholder as Qwen3VLProcessor writes it: per frame pair, `<t seconds>` then the pair's
    placeholders between vision start and end."""
    run = pad * video.frame_tokens(merge_size)
    return "".join(f"<{seconds:.1f} seconds>{start}{run}{end}" for seconds in video.timestamps)
