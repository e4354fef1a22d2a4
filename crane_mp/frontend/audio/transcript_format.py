"""OpenAI's audio transcription/translation responses (json, text, verbose_json, srt, vtt) from a finished
transcript, shaped as the openai SDK parses them: json and verbose_json as its Transcription and
TranscriptionVerbose models, text/srt/vtt as plain strings. Subtitles follow Whisper's own writers.
No torch."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass

from crane_mp.frontend.web.errors import ApiError

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
_TIMED_FORMATS = ("srt", "verbose_json", "vtt")


@dataclass(frozen=True, slots=True)
class TranscriptSegment:
    """One segment as OpenAI's verbose_json lists it (`tokens` include the timestamp tokens)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass(frozen=True, slots=True)
class Transcript:
    """task: "transcribe" or "translate"; language: OpenAI's name for it ("english"); duration: seconds
    of audio."""

    task: str
    language: str
    duration: float
    text: str
    segments: list[TranscriptSegment]


def check_response_format(response_format: str, timestamp_granularities: list[str]) -> None:
    """Refuse (400) what we cannot answer: unknown formats (diarized_json among them) and word
    timestamps. We do not align words to audio; a client that asked for them would otherwise get
    a verbose_json without the `words` it relies on."""
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", "response_format")
    for granularity in timestamp_granularities:
        if granularity == "word":
            raise ApiError(400, "word timestamps are not supported; use timestamp_granularities[]=segment",
                           "timestamp_granularities[]")
        if granularity != "segment":
            raise ApiError(400, f"unknown timestamp granularity {granularity!r}", "timestamp_granularities[]")


def needs_timestamps(response_format: str) -> bool:
    """Whether segments must carry predicted times (decode with Whisper's timestamp tokens)."""
    return response_format in _TIMED_FORMATS


def render(transcript: Transcript, response_format: str) -> tuple[str, str]:
    """(content type, body) of the response in `response_format` (checked by check_response_format).
    The content type has no charset parameter (aiohttp's `web.Response(text=..., content_type=...)`
    refuses one and adds utf-8 itself); the SDK reads text, srt and vtt bodies as strings whatever it is."""
    if response_format == "text":
        return "text/plain", transcript.text
    if response_format == "srt":
        return "text/plain", srt(transcript.segments)
    if response_format == "vtt":
        return "text/plain", vtt(transcript.segments)
    usage = {"type": "duration", "seconds": math.ceil(transcript.duration)}  # billed whole seconds, rounded up
    if response_format == "json":
        body: dict = {"text": transcript.text, "usage": usage}
    else:
        body = {"task": transcript.task, "language": transcript.language, "duration": transcript.duration,
                "text": transcript.text, "segments": [asdict(segment) for segment in transcript.segments],
                "usage": usage}
    return "application/json", json.dumps(body, ensure_ascii=False)


def srt(segments: list[TranscriptSegment]) -> str:
    """SubRip: numbered cues from 1, HH:MM:SS,mmm times, a blank line after each cue."""
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{_cue_text(s.text)}\n\n"
                   for i, s in enumerate(segments, start=1))


def vtt(segments: list[TranscriptSegment]) -> str:
    """WebVTT: the header, then cues with HH:MM:SS.mmm times, a blank line after each."""
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{_cue_text(s.text)}\n\n"
                                  for s in segments)


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: UTF-8 bytes over their zlib-compressed size."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def _clock(seconds: float, decimal_marker: str) -> str:
    milliseconds = round(max(seconds, 0.0) * 1000.0)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    seconds_part, milliseconds = divmod(milliseconds, 1_000)
    return f"{hours:02d}:{minutes:02d}:{seconds_part:02d}{decimal_marker}{milliseconds:03d}"


def _cue_text(text: str) -> str:
    # A cue's text must not hold the cue arrow; Whisper's writers replace it the same way.
    return text.strip().replace("-->", "->")
