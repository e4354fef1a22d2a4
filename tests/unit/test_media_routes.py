"""The frontend's media edges over the fake scheduler: a text model refuses image parts and the audio
routes by name; uploads must be multipart from a program; a vision-language model's images reach the
scheduler as MediaInputs at their expanded placeholders, and the OpenAPI document lists the uploads."""

from __future__ import annotations

import base64
import io

import aiohttp
import numpy as np
import pytest
from PIL import Image

from crane_mp.frontend.images import chat as chat_images
from crane_mp.frontend.openapi import build_openapi
from crane_mp.testing.make_vl import make_vl
from tests.unit.frontend_harness import start_frontend, stop_frontend


def _png_url(height: int, width: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2}


async def test_a_text_model_refuses_images_and_audio_by_name(frontend):
    client, state, fake = frontend
    image = {"type": "image_url", "image_url": {"url": _png_url(28, 28)}}
    resp = await client.post("/v1/chat/completions", json=_chat({"type": "text", "text": "hi"}, image))
    assert resp.status == 400 and "takes no images" in (await resp.json())["error"]["message"]
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF", filename="a.wav")
    resp = await client.post("/v1/audio/transcriptions", data=form)
    assert resp.status == 400 and "speech-to-text" in (await resp.json())["error"]["message"]
    assert not fake.requests


async def test_uploads_are_multipart_from_programs_only(frontend):
    client, _, _ = frontend
    resp = await client.post("/v1/audio/transcriptions", json={"file": "x"})
    assert resp.status == 415 and "multipart/form-data" in (await resp.json())["error"]["message"]
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF", filename="a.wav")
    resp = await client.post("/v1/audio/transcriptions", data=form, headers={"Origin": "https://evil.example"})
    assert resp.status == 415


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_vl(tmp_path_factory.mktemp("vl") / "model")


async def test_images_reach_the_scheduler_at_their_expanded_placeholders(vl_dir, tmp_path):
    client, state, fake = await start_frontend(vl_dir, tmp_path)
    try:
        parts = [{"type": "text", "text": "look"},
                 {"type": "image_url", "image_url": {"url": _png_url(56, 84), "detail": "low"}},
                 {"type": "image_url", "image_url": {"url": _png_url(84, 56)}}]
        resp = await client.post("/v1/chat/completions", json=_chat(*parts))
        assert resp.status == 200, await resp.text()
        [sent] = fake.requests
        token = state.image_processor.image_token_id
        assert [m.kind for m in sent.media] == ["image", "image"]
        for item in sent.media:
            assert sent.input_ids[item.offset : item.offset + item.num_tokens] == [token] * item.num_tokens
            t, h, w = item.grid
            assert item.num_tokens == t * h * w // 4 and len(item.values) == 4 * item.shape[0] * item.shape[1]
        assert sent.input_ids.count(token) == sum(item.num_tokens for item in sent.media)
        assert sent.media[0].key != sent.media[1].key
        # A placeholder typed into the text would misplace every image after it.
        typed = [{"type": "text", "text": "<|image_pad|>"}, parts[1]]
        resp = await client.post("/v1/chat/completions", json=_chat(*typed))
        assert resp.status == 400 and "image placeholders" in (await resp.json())["error"]["message"]
    finally:
        await stop_frontend(client, state)


async def test_more_images_than_allowed_are_refused_before_any_is_read(vl_dir, tmp_path, monkeypatch):
    def read(*args):
        raise AssertionError("an image was decoded or fetched")

    monkeypatch.setattr(chat_images, "open_image", read)
    monkeypatch.setattr(chat_images, "fetch_image", read)
    client, state, fake = await start_frontend(vl_dir, tmp_path)
    try:
        image = {"type": "image_url", "image_url": {"url": _png_url(2, 2)}}  # 1000 of them within 1 MiB
        resp = await client.post("/v1/chat/completions", json=_chat(*[image] * 1000))
        assert resp.status == 400
        assert "1000 images" in (message := (await resp.json())["error"]["message"])
        assert "--max-images-per-request" in message and not fake.requests
    finally:
        await stop_frontend(client, state)


def test_the_document_describes_the_uploads():
    doc = build_openapi(1000, 448, "m", 16)
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        component = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
        assert "file" in component["required"] and "response_format" in component["properties"]
    assert "language" in doc["components"]["schemas"]["TranscriptionForm"]["properties"]
    assert "language" not in doc["components"]["schemas"]["TranslationForm"]["properties"]
