"""OpenAI's transcription response formats: what the openai SDK parses (json, verbose_json as its models;
text, srt, vtt as strings) and subtitles laid out as Whisper writes them."""

from __future__ import annotations

import json

import pytest
from openai.types.audio import Transcription, TranscriptionVerbose, TranslationVerbose

from crane_mp.frontend.audio.transcript_format import (
    Transcript,
    TranscriptSegment,
    check_response_format,
    compression_ratio,
    needs_timestamps,
    render,
)
from crane_mp.frontend.web.errors import ApiError


def _segment(i: int, start: float, end: float, text: str) -> TranscriptSegment:
    return TranscriptSegment(id=i, seek=0, start=start, end=end, text=text, tokens=[415, 17, 18, 450], temperature=0.0,
                             avg_logprob=-0.25, compression_ratio=compression_ratio(text), no_speech_prob=0.0)


TRANSCRIPT = Transcript(task="transcribe", language="english", duration=3725.47,
                        text=" Hello there. The arrow --> here.",
                        segments=[_segment(0, 0.0, 3.32, " Hello there."),
                                  _segment(1, 3661.0, 3725.466, " The arrow --> here.")])


def test_json_is_the_sdk_transcription_with_duration_usage():
    content_type, body = render(TRANSCRIPT, "json")
    assert content_type == "application/json"
    parsed = Transcription.model_validate(json.loads(body))
    assert parsed.text == TRANSCRIPT.text
    assert parsed.usage.type == "duration" and parsed.usage.seconds == 3726  # whole seconds, rounded up


def test_verbose_json_is_the_sdk_verbose_transcription():
    _, body = render(TRANSCRIPT, "verbose_json")
    data = json.loads(body)
    assert list(data) == ["task", "language", "duration", "text", "segments", "usage"] and "words" not in data
    parsed = TranscriptionVerbose.model_validate(data)
    assert (parsed.language, parsed.duration, parsed.text) == ("english", 3725.47, TRANSCRIPT.text)
    first = parsed.segments[0]
    assert (first.id, first.seek, first.start, first.end, first.text, first.tokens) == (
        0, 0, 0.0, 3.32, " Hello there.", [415, 17, 18, 450])
    assert (first.temperature, first.avg_logprob, first.no_speech_prob) == (0.0, -0.25, 0.0)
    assert TranslationVerbose.model_validate(data).segments[1].start == 3661.0


def test_text_is_the_transcript_text():
    assert render(TRANSCRIPT, "text") == ("text/plain", TRANSCRIPT.text)


def test_srt_as_whisper_writes_it():
    content_type, body = render(TRANSCRIPT, "srt")
    assert content_type == "text/plain"
    assert body == ("1\n00:00:00,000 --> 00:00:03,320\nHello there.\n\n"
                    "2\n01:01:01,000 --> 01:02:05,466\nThe arrow -> here.\n\n")


def test_vtt_as_whisper_writes_it():
    _, body = render(TRANSCRIPT, "vtt")
    assert body == ("WEBVTT\n\n"
                    "00:00:00.000 --> 00:00:03.320\nHello there.\n\n"
                    "01:01:01.000 --> 01:02:05.466\nThe arrow -> here.\n\n")


def test_no_segments_still_render():
    empty = Transcript(task="translate", language="english", duration=0.5, text="", segments=[])
    assert render(empty, "srt")[1] == "" and render(empty, "vtt")[1] == "WEBVTT\n\n"
    assert json.loads(render(empty, "verbose_json")[1])["segments"] == []


def test_formats_and_granularities_we_refuse():
    check_response_format("verbose_json", ["segment"])
    for response_format, granularities, param in [("diarized_json", [], "response_format"),
                                                  ("xml", [], "response_format"),
                                                  ("verbose_json", ["segment", "word"], "timestamp_granularities[]"),
                                                  ("verbose_json", ["char"], "timestamp_granularities[]")]:
        with pytest.raises(ApiError) as err:
            check_response_format(response_format, granularities)
        assert (err.value.status, err.value.param) == (400, param)


def test_which_formats_need_timestamps():
    assert [f for f in ("json", "text", "srt", "verbose_json", "vtt") if needs_timestamps(f)] == [
        "srt", "verbose_json", "vtt"]


def test_compression_ratio_is_whispers():
    assert compression_ratio("ab" * 200) > 10 > compression_ratio("The quick brown fox.")


def test_the_openai_sdk_reads_every_format_over_http():
    """Served as aiohttp serves them, the SDK returns its models for json/verbose_json, strings otherwise."""
    import asyncio
    import threading

    from aiohttp import web
    from openai import OpenAI

    async def transcriptions(request: web.Request) -> web.Response:
        form = await request.post()
        content_type, body = render(TRANSCRIPT, form.get("response_format", "json"))
        return web.Response(text=body, content_type=content_type)

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

        def create(**kwargs):
            return client.audio.transcriptions.create(file=("a.wav", b"RIFF"), model="whisper-1", **kwargs)

        assert isinstance(create(), Transcription) and create().text == TRANSCRIPT.text
        verbose = create(response_format="verbose_json", timestamp_granularities=["segment"])
        assert isinstance(verbose, TranscriptionVerbose) and verbose.segments[1].end == 3725.466
        assert create(response_format="text") == TRANSCRIPT.text
        assert create(response_format="srt") == render(TRANSCRIPT, "srt")[1]
        assert create(response_format="vtt") == render(TRANSCRIPT, "vtt")[1]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
