"""Uploaded audio -> 16 kHz mono float32 samples, exactly as transformers' `load_audio` gives them with its
soundfile backend (so a user's reference `load_audio(path)` + feature extractor sees the same numbers).

Why soundfile: its wheels bundle libsndfile (1.2 here) with FLAC, Ogg Vorbis/Opus and MP3 built in, so
WAV, FLAC, MP3 and OGG decode with no system codecs or ffmpeg; soxr resamples as librosa does. No torch.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf
import soxr

from crane_mp.frontend.web.errors import ApiError

SAMPLING_RATE = 16000  # what Whisper's feature extractor takes


def decode_audio(data: bytes, where: str, max_seconds: float | None = None,
                 max_samples: int | None = None) -> np.ndarray:
    """The samples of the audio file `data` (any format libsndfile reads), averaged to mono and
    resampled to 16 kHz with soxr's "HQ" quality, as transformers' `_load_audio_soundfile`.

    Bytes that are not audio, a truncated header, no samples, more than `max_seconds` of audio, or more
    than `max_samples` frames x channels raise ApiError(400) naming `where` (the form field the upload
    came in)."""
    try:
        with sf.SoundFile(io.BytesIO(data)) as audio:
            source_rate = audio.samplerate
            channels = _read_channels(audio, where, max_seconds, max_samples)
        if channels.shape[1] == 0:
            raise ApiError(400, f"'{where}' holds no audio samples", where)
        waveform = channels.mean(axis=0) if channels.shape[0] > 1 else channels[0]
        if source_rate != SAMPLING_RATE:
            num_samples = math.ceil(waveform.shape[-1] * SAMPLING_RATE / source_rate)
            waveform = soxr.resample(waveform, source_rate, SAMPLING_RATE, quality="soxr_hq")
            waveform = np.pad(waveform, (0, max(0, num_samples - len(waveform))))[:num_samples]
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as err:
        # libsndfile's errors are RuntimeErrors; soxr refuses impossible rates with ValueError.
        reason = getattr(err, "error_string", None) or str(err)  # without libsndfile's "Error opening <BytesIO>"
        raise ApiError(400, f"'{where}' is not audio we can decode (WAV, FLAC, MP3 or OGG): {reason}", where) from err
    return np.ascontiguousarray(waveform, dtype=np.float32)


def _read_channels(audio: sf.SoundFile, where: str, max_seconds: float | None,
                   max_samples: int | None) -> np.ndarray:
    """[channels, frames] float32, in one read: libsndfile's MP3 decoder gives other floats read in
    blocks. The read allocates what the header declares, frames x channels, so both are checked first:
    a forged header (an hour of 8-channel silence compresses to megabytes) allocates nothing."""
    if max_seconds is not None and audio.frames > max_seconds * audio.samplerate:
        raise ApiError(400, f"'{where}' is longer than the {max_seconds:g} s this server accepts", where)
    if max_samples is not None and audio.frames * audio.channels > max_samples:
        raise ApiError(400, f"'{where}' holds {audio.frames} frames x {audio.channels} channels, more than the "
                            f"{max_samples} samples this server decodes (--max-audio-samples)", where)
    return audio.read(dtype="float32", always_2d=True).T


def audio_duration(samples: np.ndarray) -> float:
    """Seconds of 16 kHz audio (what OpenAI's verbose_json calls `duration`)."""
    return len(samples) / SAMPLING_RATE
