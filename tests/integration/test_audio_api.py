"""/v1/audio/transcriptions and /translations through the real server (Whisper, tiny random weights):
text equal to transformers' generate on the same file (up to a float32 near tie of its own) for 5 s and
65 s (long-form) clips in every container, through the openai SDK in every response format; bad uploads
are 400s within a second."""

from __future__ import annotations

import asyncio
import io
import time
from typing import NamedTuple

import numpy as np
import openai
import pytest
import requests
import soundfile as sf
import torch

from crane_mp.testing.make_whisper import make_whisper
from tests.integration.server import Server

pytestmark = pytest.mark.slow
FORMATS = ("WAV", "FLAC", "MP3", "OGG")


def clip(seconds: float, seed: int) -> np.ndarray:
    """A warbling tone with noise: enough structure for the random model to say several things."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (200 + 40 * seed) * t * (1 + 0.1 * np.sin(t)))
    return (tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def encoded(seconds: float, fmt: str, seed: int = 0, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    samples = clip(seconds, seed)
    if rate != 16000:  # a 44.1 kHz stereo file: resampled and mixed down as transformers' loader does
        samples = np.stack([np.interp(np.arange(0, len(samples), 16000 / rate), np.arange(len(samples)), samples)] * 2,
                           axis=1)
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_whisper(tmp_path_factory.mktemp("whisper") / "model")


# Top-2 logit gap under which float32 runs summing in another order (another device) may pick differently:
# transformers' own CPU and CUDA runs of the prompted clip below part at a step 2e-4 apart.
FLOAT32_TIE = 1e-3


class Reference(NamedTuple):
    text: str  # generate's
    stable: str  # its text before its first step whose two best logits are a float32 near tie


def matches(got: str, want: Reference) -> bool:
    """Generate's text, or past a near tie of its own, its text up to there (a partial character cut)."""
    return got == want.text or (want.stable != want.text and got.startswith(want.stable.rstrip("\ufffd")))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """transform(file bytes, **generate kwargs) -> what transformers gives for that file (a Reference)."""
    from transformers import AutoProcessor, WhisperForConditionalGeneration
    from transformers.audio_utils import load_audio

    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("clips")
    known: dict[tuple, Reference] = {}  # lossless containers of the same samples decode alike: generate once

    def transform(data: bytes, **kwargs) -> Reference:
        path = folder / f"clip{len(list(folder.iterdir()))}"
        path.write_bytes(data)
        audio = load_audio(str(path))
        key = (audio.tobytes(), tuple(sorted(kwargs.items())))
        if key not in known:
            known[key] = _generate(audio, **kwargs)
        return known[key]

    def _generate(audio, **kwargs) -> Reference:
        long_form = len(audio) > 30 * 16000
        extra = {"truncation": False, "padding": "longest", "return_attention_mask": True} if long_form else {}
        features = processor(audio, sampling_rate=16000, return_tensors="pt", **extra)
        if "prompt" in kwargs:
            kwargs["prompt_ids"] = torch.tensor(processor.get_prompt_ids(kwargs.pop("prompt")))
        with torch.no_grad():
            if long_form:
                out = model.generate(**features, return_timestamps=True, **kwargs)
                text = processor.batch_decode(out, skip_special_tokens=True)[0]
                return Reference(text, text)
            out = model.generate(**features, **kwargs, output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0]
        gaps = [scores[0].topk(2).values for scores in out.scores]
        tie = next((step for step, top in enumerate(gaps) if top[0] - top[1] < FLOAT32_TIE), None)
        text = processor.decode(tokens, skip_special_tokens=True)
        if tie is None:
            return Reference(text, text)
        # The sequence ends with one token a score: the tied step's token sits len(scores) - tie from the end.
        cut = max(0, len(tokens) - len(out.scores) + tie)
        return Reference(text, processor.decode(tokens[:cut], skip_special_tokens=True))

    return transform


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = Server(model_dir, log_path=tmp_path_factory.mktemp("log") / "log")
    yield server
    assert server.stop() == 0


def test_transcriptions_equal_generate_for_short_and_long_clips_in_every_container(server, reference):
    """A short clip in every container; a long one (three windows) in a lossless and a lossy one: the
    containers' decoders do not depend on the length."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for seconds, formats in ((5, FORMATS), (65, ("FLAC", "MP3"))):
        texts = {}
        for fmt in formats:
            data = encoded(seconds, fmt)
            got = client.audio.transcriptions.create(model=server_model(server), file=(f"a.{fmt.lower()}", data))
            assert matches(got.text, reference(data)), (seconds, fmt)
            texts[fmt] = got.text
        assert texts.get("WAV", texts["FLAC"]) == texts["FLAC"]  # lossless: the same samples
    stereo = encoded(5, "WAV", seed=1, rate=44100)
    got = client.audio.transcriptions.create(model=server_model(server), file=("s.wav", stereo))
    assert matches(got.text, reference(stereo))


def test_every_response_format_through_the_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    data = encoded(35, "FLAC", seed=2)  # long-form: two windows
    model = server_model(server)
    verbose = client.audio.transcriptions.create(model=model, file=("a.flac", data), response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    assert verbose.duration == pytest.approx(35.0) and verbose.language and verbose.segments
    # Ends as generate's segments have them: a random model may stamp one past the audio.
    assert all(s.start <= s.end for s in verbose.segments) and verbose.segments[0].start < 35.0
    assert [s.id for s in verbose.segments] == list(range(len(verbose.segments)))
    text = client.audio.transcriptions.create(model=model, file=("a.flac", data), response_format="text")
    assert isinstance(text, str) and text == verbose.text
    srt = client.audio.transcriptions.create(model=model, file=("a.flac", data), response_format="srt")
    assert srt.startswith("1\n00:00:") and srt.count(" --> ") == len(verbose.segments)
    vtt = client.audio.transcriptions.create(model=model, file=("a.flac", data), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:") and vtt.count(" --> ") == len(verbose.segments)
    plain = client.audio.transcriptions.create(model=model, file=("a.flac", data), response_format="json")
    assert plain.text == verbose.text


def test_language_prompt_and_translation_equal_generate(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    data = encoded(5, "WAV", seed=3)
    model = server_model(server)
    french = client.audio.transcriptions.create(model=model, file=("a.wav", data), language="fr")
    assert matches(french.text, reference(data, language="fr"))
    prompted = client.audio.transcriptions.create(model=model, file=("a.wav", data), language="en", prompt="hello")
    assert matches(prompted.text, reference(data, language="en", prompt="hello"))
    translated = client.audio.translations.create(model=model, file=("a.wav", data))
    assert matches(translated.text, reference(data, task="translate"))


def test_concurrent_transcriptions_batch_and_each_equals_its_own(server):
    clips = [encoded(seconds, "WAV", seed=seed) for seconds, seed in ((65, 4), (5, 5), (12, 6))]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        return await asyncio.gather(*(client.audio.transcriptions.create(
            model=server_model(server), file=(f"{i}.wav", data)) for i, data in enumerate(clips)))

    together = [r.text for r in asyncio.run(run())]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    alone = [client.audio.transcriptions.create(model=server_model(server), file=("a.wav", d)).text for d in clips]
    assert together == alone


def test_bad_uploads_are_400s_within_a_second_and_the_server_keeps_serving(server):
    url = server.url + "/v1/audio/transcriptions"
    good = encoded(5, "WAV", seed=7)
    cases = {
        "not audio": ({"file": ("a.wav", b"RIFF" + b"\x00" * 100)}, {}),
        "truncated": ({"file": ("a.flac", encoded(5, "FLAC")[:300])}, {}),
        "empty": ({"file": ("a.wav", b"")}, {}),
        "no file": ({"model": (None, "x")}, {}),
        "unknown format": ({"file": ("a.wav", good)}, {"response_format": "xml"}),
        "word timestamps": ({"file": ("a.wav", good)}, {"timestamp_granularities[]": "word"}),
        "unknown language": ({"file": ("a.wav", good)}, {"language": "xx"}),
        "temperature": ({"file": ("a.wav", good)}, {"temperature": "7"}),
    }
    for name, (files, data) in cases.items():
        started = time.monotonic()
        resp = requests.post(url, files=files, data=data, timeout=30)
        assert resp.status_code == 400, (name, resp.text)
        assert time.monotonic() - started < 1.0, name
        assert resp.json()["error"]["message"], name
    assert requests.post(url, json={"file": "x"}, timeout=30).status_code == 415
    chat = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                         timeout=30)
    assert chat.status_code == 400 and "/v1/audio/transcriptions" in chat.text
    ok = requests.post(url, files={"file": ("a.wav", good)}, data={"response_format": "text"}, timeout=60)
    assert ok.status_code == 200 and ok.headers["Content-Type"].startswith("text/plain")
    assert "audio_seconds=5.0" in server.log_path.read_text()
    assert "crane:request_audio_seconds_count" in requests.get(server.url + "/metrics", timeout=10).text


def server_model(server: Server) -> str:
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_an_english_only_model_takes_english_and_refuses_other_languages(tmp_path):
    """whisper-*.en checkpoints: OpenAI clients send language=en, which transcribes as generate does
    without a language (it refuses one for such a model); another language or a translation is a 400."""
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    model_dir = make_whisper(tmp_path / "model-en", english_only=True)
    data = encoded(5, "WAV", seed=4)
    samples, _ = sf.read(io.BytesIO(data), dtype="float32")
    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(**processor(samples, sampling_rate=16000, return_tensors="pt"))
    want = processor.batch_decode(ids, skip_special_tokens=True)[0]
    server = Server(model_dir, log_path=tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model_name = server_model(server)
        for language in (None, "en", "English"):
            extra = {} if language is None else {"language": language}
            got = client.audio.transcriptions.create(model=model_name, file=("a.wav", data), **extra)
            assert got.text == want, language
        with pytest.raises(openai.BadRequestError, match="English-only: it cannot transcribe language 'fr'"):
            client.audio.transcriptions.create(model=model_name, file=("a.wav", data), language="fr")
        with pytest.raises(openai.BadRequestError, match="English-only"):
            client.audio.translations.create(model=model_name, file=("a.wav", data))
    finally:
        assert server.stop() == 0
