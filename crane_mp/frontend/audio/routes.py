"""/v1/audio/transcriptions and /v1/audio/translations (OpenAI's, served by a Whisper checkpoint):
a multipart upload decoded to 16 kHz, its log-mel features, then transformers' Whisper generate
mirrored window by window (whisper_plan.py) through the engine, rendered in the asked format.

One transcription is a sequence of engine requests, one per 30 s window (each window's start depends
on the previous one's timestamps); each carries its window's features, which the worker encodes once,
and decodes in the same continuous batches as every other request."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Annotated

import msgspec
import numpy as np
from aiohttp import web

from crane_mp.frontend.audio.decode import audio_duration, decode_audio
from crane_mp.frontend.audio.transcript_format import check_response_format, needs_timestamps, render
from crane_mp.frontend.audio.whisper_features import log_mel
from crane_mp.frontend.audio.whisper_plan import DecodedWindow, make_transcript, prompt_token_ids, transcribe
from crane_mp.frontend.serving.choices import start_generation
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.access_log import current_record
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.protocol import MediaInput, SamplingParams, WhisperDecoding

api = RouteTable()
ResponseFormat = Annotated[str, msgspec.Meta(examples=["json", "text", "srt", "verbose_json", "vtt"])]


class TranslationForm(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's fields; `timestamp_granularities[]` arrives as the list timestamp_granularities."""

    file: Annotated[bytes, msgspec.Meta(description="the audio: WAV, FLAC, MP3 or OGG (Vorbis, Opus)")]
    model: str | None = None
    prompt: str | None = None  # text the window's decoding continues from (Whisper's previous-text prompt)
    response_format: ResponseFormat = "json"
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    timestamp_granularities: list[str] = []
    stream: bool = False


class TranscriptionForm(TranslationForm, forbid_unknown_fields=False):
    language: str | None = None  # ISO-639-1 ("en") or the name ("english"); detected when absent


@api.add("post", "/v1/audio/transcriptions", form=TranscriptionForm, requires=FrontendState.require_transcription,
         generation=True, errors=(*GENERATION_ERRORS, "415"), summary="Transcribe audio (multipart upload)")
async def transcriptions(request: web.Request, form: TranscriptionForm) -> web.Response:
    return await _run(request, form, form.language, None)


@api.add("post", "/v1/audio/translations", form=TranslationForm, requires=FrontendState.require_transcription,
         generation=True, errors=(*GENERATION_ERRORS, "415"), summary="Translate audio to English text")
async def translations(request: web.Request, form: TranslationForm) -> web.Response:
    return await _run(request, form, None, "translate")


async def _run(request: web.Request, form: TranslationForm, language: str | None, task: str | None) -> web.Response:
    state = request.app[STATE]
    await resolve_model(state, form.model)
    if form.stream:
        raise ApiError(400, "streamed transcriptions are not supported; leave stream unset", "stream")
    check_response_format(form.response_format, form.timestamp_granularities)
    speech, tokenizer = state.speech, state.tokenizer.tokenizer
    samples = await asyncio.to_thread(decode_audio, form.file, "file", state.config.max_audio_seconds,
                                      state.config.audio_sample_limit)
    duration = audio_duration(samples)
    record = current_record()
    if record is not None:
        record.audio_seconds = duration
    state.metrics.media_received(audio_seconds=duration)
    prompt = prompt_token_ids(tokenizer, form.prompt, speech.settings) if form.prompt else []
    features = await asyncio.to_thread(log_mel, speech.feature_extractor, samples)
    decode = window_decoder(state, [f"audio-{uuid.uuid4().hex}"])
    result = await transcribe(features, speech.settings, decode, language=language, task=task,
                              timestamps=True if needs_timestamps(form.response_format) else None,
                              prompt_ids=prompt, temperature=form.temperature)
    transcript = make_transcript(result, speech.settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                 duration)
    content_type, body = render(transcript, form.response_format)
    return web.Response(text=body, content_type=content_type)


def window_decoder(state, names: list[str]):
    """The `decode` whisper_plan.transcribe calls: one engine request per window, its generated ids and
    their logprobs (for the segments' avg_logprob)."""

    async def decode(window: np.ndarray, prompt_ids: list[int], rules: WhisperDecoding, max_new_tokens: int,
                     temperature: float) -> DecodedWindow:
        values = np.ascontiguousarray(window, dtype=np.float32)
        key = hashlib.sha256(values.tobytes()).hexdigest()
        media = [MediaInput("audio", key, list(values.shape), values.tobytes())]
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, whisper=rules, logprobs=0)
        gen = await start_generation(state.client, state.tokenizer.backend, prompt_ids, params, [], names=names,
                                     media=media)
        ids, logprobs = [], []
        async for delta in gen.deltas():
            ids += delta.token_ids
            logprobs += [entry.logprob for entry in delta.logprobs if entry is not None]
        return DecodedWindow(ids, logprobs if len(logprobs) == len(ids) else None)

    return decode
