"""decode_audio gives, for WAV, FLAC, MP3 and OGG uploads, the very samples transformers' load_audio reads
from the same file (soundfile backend), and answers a 400 naming the field for anything else."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
from transformers.audio_utils import load_audio

from crane_mp.config import EngineConfig, ServerConfig
from crane_mp.frontend.audio.decode import audio_duration, decode_audio
from crane_mp.frontend.web.errors import ApiError

# (format, subtype, sample rate, channels): resampled and downmixed cases, and one already 16 kHz mono.
CASES = [("WAV", "PCM_16", 44100, 2), ("WAV", "FLOAT", 16000, 1), ("FLAC", "PCM_24", 22050, 2),
         ("OGG", "VORBIS", 48000, 2), ("OGG", "OPUS", 48000, 1), ("MP3", "MPEG_LAYER_III", 44100, 2)]


def _signal(rate: int, channels: int, seconds: float = 2.7) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    waves = [0.4 * np.sin(2 * np.pi * (330 + 110 * c) * t) for c in range(channels)]
    noise = 0.03 * np.random.default_rng(channels).standard_normal((len(t), channels))
    return np.stack(waves, axis=1) + noise  # [frames, channels]


def _write(tmp_path, fmt: str, subtype: str, rate: int, channels: int, seconds: float = 2.7):
    path = tmp_path / f"clip.{fmt.lower()}"
    sf.write(path, _signal(rate, channels, seconds), rate, format=fmt, subtype=subtype)
    return path


@pytest.mark.parametrize("fmt, subtype, rate, channels", CASES)
def test_same_samples_as_transformers_load_audio(tmp_path, fmt, subtype, rate, channels):
    path = _write(tmp_path, fmt, subtype, rate, channels)
    expected = load_audio(str(path), sampling_rate=16000)
    samples = decode_audio(path.read_bytes(), "file")
    assert samples.dtype == np.float32 and samples.flags.c_contiguous
    np.testing.assert_array_equal(samples, expected)
    assert audio_duration(samples) == len(expected) / 16000


def test_long_audio_is_read_in_blocks_to_the_same_samples(tmp_path):
    path = _write(tmp_path, "FLAC", "PCM_16", 16000, 1, seconds=40.0)  # more frames than one block
    np.testing.assert_array_equal(decode_audio(path.read_bytes(), "file"), load_audio(str(path)))


@pytest.mark.parametrize("data", [b"", b"RIFF", b"not audio at all " * 64, bytes(range(256)) * 40,
                                  b"fLaC\x00\x00\x00\x22" + bytes(30)])
def test_bytes_that_are_not_audio_are_a_400_naming_the_field(data):
    with pytest.raises(ApiError) as err:
        decode_audio(data, "file")
    assert (err.value.status, err.value.param) == (400, "file") and "'file'" in err.value.message


@pytest.mark.parametrize("fmt, subtype, rate, channels", CASES)
def test_truncated_uploads_decode_or_are_a_400(tmp_path, fmt, subtype, rate, channels):
    data = _write(tmp_path, fmt, subtype, rate, channels).read_bytes()
    for cut in (4, 44, 200, len(data) // 3):
        try:
            samples = decode_audio(data[:cut], "file")
        except ApiError as err:
            assert err.status == 400
        else:
            assert samples.dtype == np.float32 and np.isfinite(samples).all()


def test_a_file_without_samples_is_a_400():
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((0, 1)), 16000, format="WAV")
    with pytest.raises(ApiError) as err:
        decode_audio(buffer.getvalue(), "file")
    assert err.value.status == 400 and "no audio" in err.value.message


def test_longer_than_allowed_is_a_400(tmp_path):
    data = _write(tmp_path, "WAV", "PCM_16", 16000, 1, seconds=3.0).read_bytes()
    assert len(decode_audio(data, "file", max_seconds=3.0)) == 48000
    with pytest.raises(ApiError) as err:
        decode_audio(data, "file", max_seconds=2.5)
    assert err.value.status == 400 and "2.5 s" in err.value.message


def _flac_declaring(frames: int, channels: int, rate: int) -> bytes:
    """0.1 s of FLAC silence whose STREAMINFO declares `frames` frames: its total-samples field, the low
    36 bits of the 8 bytes after the rate (4 bytes "fLaC", 4 of block header, 10 of block sizes)."""
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros((rate // 10, channels)), rate, format="FLAC", subtype="PCM_16")
    data = bytearray(buffer.getvalue())
    field = int.from_bytes(data[18:26], "big")
    data[18:26] = ((field & ~((1 << 36) - 1)) | frames).to_bytes(8, "big")
    return bytes(data)


def test_more_samples_than_allowed_are_a_400_before_any_is_decoded(monkeypatch):
    # An hour of 8-channel 48 kHz audio: within --max-audio-seconds, yet 5.5 GB of float32 samples.
    data = _flac_declaring(3600 * 48000, 8, 48000)

    def read(*args, **kwargs):
        raise AssertionError("the samples were decoded")

    monkeypatch.setattr(sf.SoundFile, "read", read)
    with pytest.raises(ApiError) as err:
        decode_audio(data, "file", max_seconds=3600.0, max_samples=3600 * 96000)
    assert (err.value.status, err.value.param) == (400, "file") and "--max-audio-samples" in err.value.message


def test_the_sample_bound_counts_frames_times_channels(tmp_path):
    data = _write(tmp_path, "WAV", "PCM_16", 16000, 2, seconds=1.0).read_bytes()
    assert len(decode_audio(data, "file", max_samples=32000)) == 16000
    with pytest.raises(ApiError):
        decode_audio(data, "file", max_samples=31999)


def test_the_default_sample_bound_is_48_khz_stereo_for_the_longest_audio():
    config = ServerConfig(EngineConfig("m"), "m", max_audio_seconds=60.0)
    assert config.audio_sample_limit == 60 * 48000 * 2
    assert replace(config, max_audio_samples=1000).audio_sample_limit == 1000
