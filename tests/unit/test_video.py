"""Videos (Qwen3-VL, Qwen3.5): frames sampled, sized and timed by the rules of transformers'
Qwen3VLVideoProcessor / Qwen3VLProcessor (called here where they run without torchvision), decoded with
PyAV; a video past the server's limits refused from its header, before any frame is decoded."""

from __future__ import annotations

import io
import time
from fractions import Fraction

import av
import numpy as np
import pytest
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from crane_mp.frontend.images.data_url import data_url_bytes
from crane_mp.frontend.images.video import (
    VideoLimits,
    VideoSettings,
    decode_video,
    preprocess_video,
    sample_indices,
    video_size,
    video_text,
)
from crane_mp.frontend.web.errors import ApiError
from crane_mp.testing.make_vl import make_video

SETTINGS = VideoSettings(min_frames=4, max_frames=32, min_pixels=4096, max_pixels=6 * 128 * 128)
LIMITS = VideoLimits(max_seconds=300, max_frames=256, max_pixels=1 << 25)


@pytest.mark.parametrize("total,fps", [(12, 4.0), (3, 30.0), (900, 30.0), (61, 24.0), (5000, 25.0)])
def test_frames_are_sampled_as_the_processor_samples_them(total, fps):
    reference = Qwen3VLVideoProcessor(fps=2, min_frames=4, max_frames=32)
    metadata = VideoMetadata(total_num_frames=total, fps=fps, width=64, height=64)
    assert sample_indices(total, fps, SETTINGS).tolist() == reference.sample_frames(metadata).tolist()


@pytest.mark.parametrize("frames,height,width", [(6, 64, 96), (4, 20, 500), (32, 720, 1280), (5, 100, 30)])
def test_frames_are_sized_as_the_processor_sizes_them(frames, height, width):
    assert video_size(frames, height, width, SETTINGS) == smart_resize(frames, height, width, 2, 32, 4096,
                                                                       6 * 128 * 128)


def test_a_video_is_cut_into_frame_pairs_with_the_processors_timestamps():
    frames, indices, fps = decode_video(make_video(12, 4, 64, 96), SETTINGS, LIMITS, "v")
    assert len(frames) == 6 and fps == 4.0 and frames[0].shape == (64, 96, 3) and frames[0].dtype == np.uint8
    video = preprocess_video(frames, indices, fps, SETTINGS)
    assert video.grid_thw == (3, 4, 6) and video.pixel_values.shape == (3 * 4 * 6, 3 * 2 * 16 * 16)
    assert video.timestamps == Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)
    assert video_text(video, 2, "<s>", "<v>", "</s>") == "".join(
        f"<{t:.1f} seconds><s>{'<v>' * 6}</s>" for t in video.timestamps)
    # An odd count: the last frame fills the last pair.
    odd = preprocess_video(frames[:5], indices[:5], fps, SETTINGS)
    assert odd.grid_thw[0] == 3 and odd.key != video.key
    assert np.array_equal(odd.pixel_values[-24:].reshape(24, 3, 2, 256)[:, :, 0],
                          odd.pixel_values[-24:].reshape(24, 3, 2, 256)[:, :, 1])


def _long_video(seconds: int) -> bytes:
    """Three frames spread over `seconds`: a long video in a few kilobytes."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(2, seconds))
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_videos_past_the_limits_or_not_videos_are_refused_from_their_header():
    started = time.monotonic()
    with pytest.raises(ApiError, match=r"v: the video is \d+\.\d s long; this server takes at most 300 s"):
        decode_video(_long_video(600), SETTINGS, LIMITS, "v")
    with pytest.raises(ApiError, match="samples to 6 frames; this server takes at most 5"):
        decode_video(make_video(12, 4, 64, 96), SETTINGS, VideoLimits(300, 5, 1 << 25), "v")
    with pytest.raises(ApiError, match="64x96|96x64"):
        decode_video(make_video(12, 4, 64, 96), SETTINGS, VideoLimits(300, 256, 1000), "v")
    assert time.monotonic() - started < 5.0
    for data, why in ((b"not a video at all" * 10, "not a video"), (make_video(12, 4, 64, 96)[:600], "video")):
        with pytest.raises(ApiError, match=why):
            decode_video(data, SETTINGS, LIMITS, "v")
    with pytest.raises(ApiError, match="not a video"):
        data_url_bytes("data:image/png;base64,AAAA", "v", "video")
    assert data_url_bytes("data:video/mp4;base64,AAAA", "v", "video") == b"\0\0\0"
