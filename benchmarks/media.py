"""Images and audio through the server against transformers on the same machine, in one run.

    python benchmarks/media.py [--clips 4 --seconds 65 --images 8]

Writes the tiny Qwen2.5-VL and Whisper checkpoints (crane_mp.testing.make_vl / make_whisper) to a
temporary directory, then for each: transformers' float32 `generate` one request after another, and
crane-launch (float32) with every request sent at once. Prints one JSON line per model: wall seconds
of each side, and audio seconds transcribed per second (Whisper) or image requests per second (VL).
Tiny random models measure the serving path (decoding, preprocessing, batching of windows and
images), not a real model's compute.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import requests
import soundfile as sf
import torch
from PIL import Image

_TOKENS = 32


def _serve(model: Path, log: Path, port: int = 18631) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "crane_mp", "--model-path", str(model), "--port", str(port),
                             "--dtype", "float32"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(log.read_text())


def _clip(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    samples = (0.3 * np.sin(2 * np.pi * (200 + 30 * seed) * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="FLAC")
    return buf.getvalue()


def whisper(folder: Path, clips: int, seconds: float) -> dict:
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    from crane_mp.frontend.audio.decode import decode_audio
    from crane_mp.testing.make_whisper import make_whisper

    model_dir = make_whisper(folder / "whisper")
    files = [_clip(seconds, seed) for seed in range(clips)]
    processor = AutoProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    started = time.perf_counter()
    for data in files:
        audio = decode_audio(data, "file")
        features = processor(audio, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                             return_attention_mask=True)
        with torch.no_grad():
            model.generate(**features, return_timestamps=True)
    reference = time.perf_counter() - started
    proc, url = _serve(model_dir, folder / "whisper.log")
    try:
        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                async def one(data: bytes) -> None:
                    form = aiohttp.FormData()
                    form.add_field("file", data, filename="a.flac")
                    async with session.post(url + "/v1/audio/transcriptions", data=form) as resp:
                        assert resp.status == 200, await resp.text()

                await asyncio.gather(*(one(data) for data in files))

        asyncio.run(run())  # warm (windows never hit the prefix cache: their audio keys every block)
        started = time.perf_counter()
        asyncio.run(run())
        served = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(30)
    audio_seconds = clips * seconds
    return {"model": "whisper (tiny, random)", "clips": clips, "seconds_each": seconds,
            "transformers_s": round(reference, 2), "crane_mp_s": round(served, 2),
            "transformers_audio_s_per_s": round(audio_seconds / reference, 1),
            "crane_mp_audio_s_per_s": round(audio_seconds / served, 1)}


def vision_language(folder: Path, images: int) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from crane_mp.testing.make_vl import make_vl, reference_processor

    model_dir = make_vl(folder / "vl")
    rng = np.random.default_rng(0)
    # The second half is timed: the first only warms the server (another image never hits the prefix cache).
    every = [Image.fromarray(rng.integers(0, 255, (224, 336, 3), dtype=np.uint8)) for _ in range(2 * images)]
    pictures = every[images:]
    processor = reference_processor(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    parts = [{"type": "image"}, {"type": "text", "text": "describe"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=False)
    started = time.perf_counter()
    for picture in pictures:
        inputs = processor(text=[prompt], images=[picture], return_tensors="pt")
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=_TOKENS, min_new_tokens=_TOKENS, do_sample=False)
    reference = time.perf_counter() - started
    urls = []
    for picture in every:
        buf = io.BytesIO()
        picture.save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    proc, url = _serve(model_dir, folder / "vl.log")
    try:
        async def run(batch: list[str]) -> None:
            async with aiohttp.ClientSession() as session:
                async def one(image_url: str) -> None:
                    body = {"messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "describe"}]}],
                        "max_tokens": _TOKENS, "min_tokens": _TOKENS, "temperature": 0}
                    async with session.post(url + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()

                await asyncio.gather(*(one(u) for u in batch))

        asyncio.run(run(urls[:images]))
        started = time.perf_counter()
        asyncio.run(run(urls[images:]))
        served = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(30)
    return {"model": "qwen2.5-vl (tiny, random)", "requests": images, "tokens_each": _TOKENS,
            "transformers_s": round(reference, 2), "crane_mp_s": round(served, 2),
            "transformers_requests_per_s": round(images / reference, 2),
            "crane_mp_requests_per_s": round(images / served, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=65.0)
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(whisper(Path(tmp), args.clips, args.seconds)))
        print(json.dumps(vision_language(Path(tmp), args.images)))


if __name__ == "__main__":
    main()
