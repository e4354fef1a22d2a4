"""Image parts in the frontend: data URLs, decoding within the pixel budget (a 400 naming the part for
anything bad, before pixels are decoded when the header is too large), and patches and placeholders
equal to what transformers' processor gives its own generate."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from PIL import Image, ImageFile

from crane_mp.frontend.images.data_url import data_url_bytes
from crane_mp.frontend.images.processor import (
    expand_image_tokens,
    load_image_processor,
    open_image,
)
from crane_mp.frontend.web.errors import ApiError
from crane_mp.testing.make_vl import make_vl, reference_processor

WHERE = "messages[0].content[1]"


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def _noise(height: int, width: int, channels: int = 3, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA" if channels == 4 else "RGB")


def _huge_png(width: int, height: int) -> bytes:
    """A valid one-bit PNG of width x height: all black, so it compresses to a few kB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def _refused(data: bytes, max_pixels: int = 1 << 25) -> ApiError:
    started = time.monotonic()
    with pytest.raises(ApiError) as caught:
        open_image(data, max_pixels, WHERE)
    assert time.monotonic() - started < 1.0
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert caught.value.message.startswith(WHERE)
    return caught.value


def test_data_url_gives_its_bytes():
    data = _encoded(_noise(8, 8), "PNG")
    encoded = base64.b64encode(data).decode()
    assert data_url_bytes(f"data:image/png;base64,{encoded}", WHERE, "image") == data
    wrapped = "\n".join(encoded[i : i + 40] for i in range(0, len(encoded), 40))  # line-wrapped base64
    assert data_url_bytes(f"data:image/png;base64,{wrapped}", WHERE, "image") == data


@pytest.mark.parametrize("url", [
    "data:image/png;base64",  # no data
    "data:image/png,iVBORw0KGgo=",  # not base64
    "data:text/plain;base64,aGVsbG8=",  # not an image
    "data:image/png;base64,iVBOR*w0KGgo=",  # not base64 characters
    "data:image/png;base64,iVBORw0KGgo",  # bad padding
    "data:image/png;base64,",  # empty
    "image/png;base64,iVBORw0KGgo=",  # not a data URL
])
def test_malformed_data_urls_are_400(url):
    with pytest.raises(ApiError) as caught:
        data_url_bytes(url, WHERE, "image")
    assert caught.value.status == 400 and WHERE in caught.value.message


def test_not_an_image_is_400():
    assert "not an image" in _refused(b"hello, this is text and not a picture").message
    assert "not an image" in _refused(b"%!PS-Adobe-3.0 EPSF-3.0\n").message  # formats we do not open


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("kept", [0.5, 0.9, -20, -5])
def test_truncated_images_are_400(fmt, kept):
    data = _encoded(_noise(64, 80), fmt)
    cut = data[: int(len(data) * kept)] if kept > 0 else data[:kept]
    message = _refused(cut).message
    # libwebp reads the whole file when PIL opens it, so a cut WebP already fails there.
    assert "truncated or corrupt" in message or (fmt == "WEBP" and "damaged" in message)


def test_truncated_images_are_400_even_when_pil_is_told_to_load_them():
    data = _encoded(_noise(64, 80), "PNG")
    with mock.patch.object(ImageFile, "LOAD_TRUNCATED_IMAGES", True):
        _refused(data[: len(data) // 2])


def test_too_many_pixels_are_refused_before_decoding():
    data = _huge_png(10_000, 5_000)  # 50 megapixels in a few kB
    assert len(data) < 100_000
    with mock.patch.object(ImageFile.ImageFile, "load", side_effect=AssertionError("decoded")):
        error = _refused(data, max_pixels=1 << 25)
    assert "10000x5000" in error.message and "--max-image-pixels" in error.message


def test_images_past_pils_own_bomb_limit_are_400():
    _refused(_huge_png(20_000, 10_000), max_pixels=1 << 40)  # PIL raises DecompressionBombError itself


def test_an_image_at_the_limit_decodes():
    image = open_image(_encoded(_noise(30, 40), "PNG"), 30 * 40, WHERE)
    assert image.mode == "RGB" and image.size == (40, 30)
    _refused(_encoded(_noise(30, 41), "PNG"), 30 * 40)


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert open_image(_encoded(rgba, "PNG"), 100, WHERE).getpixel((0, 0)) == (255, 255, 255)
    gray = open_image(_encoded(Image.new("L", (4, 4), 7), "PNG"), 100, WHERE)
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (7, 7, 7)


def test_expand_image_tokens():
    expanded, spans = expand_image_tokens([1, 5, 9, 6, 2, 5, 9, 6, 3], 9, [3, 2])
    assert expanded == [1, 5, 9, 9, 9, 6, 2, 5, 9, 9, 6, 3]
    assert spans == [(2, 3), (8, 2)]
    with pytest.raises(ValueError):
        expand_image_tokens([1, 9, 2], 9, [3, 2])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_vl(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", seed=0)


def test_patches_and_placeholders_equal_the_processor(checkpoint):
    """Three images of different sizes and kinds, through our path and through transformers' processor
    (the PIL images as the bytes open, the rendered template with one placeholder per image)."""
    processor = reference_processor(checkpoint)
    ours = load_image_processor(checkpoint)
    files = [_encoded(_noise(150, 200), "PNG"), _encoded(_noise(300, 90, 4, seed=1), "PNG"),
             _encoded(_noise(40, 40, seed=2), "JPEG")]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"},
                                             {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="np")

    images = [ours.preprocess(open_image(f, 1 << 25, WHERE)) for f in files]
    assert np.array_equal(np.concatenate([image.pixel_values for image in images]), expected["pixel_values"])
    assert [list(image.grid_thw) for image in images] == expected["image_grid_thw"].tolist()
    ids, spans = expand_image_tokens(processor.tokenizer(text)["input_ids"], ours.image_token_id,
                                     [image.num_tokens for image in images])
    assert ids == expected["input_ids"][0].tolist()
    kinds = expected["mm_token_type_ids"][0]
    assert all(kinds[offset : offset + count].all() for offset, count in spans)
    assert sum(count for _, count in spans) == kinds.sum()
    assert len({image.key for image in images}) == 3
    assert ours.preprocess(open_image(files[0], 1 << 25, WHERE)).key == images[0].key


def test_an_image_the_processor_refuses_is_400(checkpoint):
    processor = load_image_processor(checkpoint)
    with pytest.raises(ApiError) as caught:
        processor.preprocess(open_image(_encoded(Image.new("RGB", (300, 1)), "PNG"), 1 << 25, WHERE), WHERE)
    assert caught.value.status == 400 and "aspect ratio" in caught.value.message


def test_pixel_bounds_per_server_and_per_request_equal_the_processor_given_them(checkpoint):
    """--mm-processor-kwargs sets the server's bounds; a request's mm_processor_kwargs may lower them.
    Either way the patches equal transformers' processor called with the same bounds."""
    processor = reference_processor(checkpoint).image_processor
    image = _noise(300, 260)
    server = load_image_processor(checkpoint, {"min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 64})
    expected = processor(images=[image], return_tensors="np", size={"shortest_edge": 28 * 28 * 16,
                                                                     "longest_edge": 28 * 28 * 64})
    ours = server.preprocess(image)
    assert np.array_equal(ours.pixel_values, expected["pixel_values"])
    assert ours.num_tokens <= 64 < load_image_processor(checkpoint).preprocess(image).num_tokens
    settings = server.settings({"max_pixels": 28 * 28 * 20})
    expected = processor(images=[image], return_tensors="np", size=settings["size"])
    assert np.array_equal(server.preprocess(image, WHERE, settings).pixel_values, expected["pixel_values"])
    assert settings["size"]["shortest_edge"] == 28 * 28 * 16
    assert server.settings({"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 8})["size"] == {
        "shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 8}
    for bad, why in (({"max_pixels": 28 * 28 * 65}, "above this server's"), ({"max_pixels": 0}, "positive integer"),
                     ({"min_pixels": 28 * 28 * 65}, "above max_pixels"), ({"size": 3}, "size not taken"),
                     ([1], "must be an object"), ({"max_pixels": True}, "positive integer")):
        with pytest.raises(ApiError, match=why) as caught:
            server.settings(bad)
        assert caught.value.status == 400 and caught.value.param == "mm_processor_kwargs"
    with pytest.raises(ValueError, match="min_pixels .* is above max_pixels"):
        load_image_processor(checkpoint, {"min_pixels": 28 * 28 * 500})


def test_gemma3_images_expand_as_its_processor_writes_them(tmp_path):
    """Gemma 3: a wide image is the whole one and four pan-and-scan crops (the checkpoint's processor asks
    for them), written into the text as its processor writes it; each crop is its own run of soft
    tokens. A prompt given as tokens (/generate) gets each placeholder's expansion spliced in."""
    model_dir = make_vl(tmp_path / "gemma3", family="gemma3", pan_and_scan=True)
    ours = load_image_processor(model_dir)
    reference = reference_processor(model_dir)
    image = ours.preprocess(_noise(40, 200))
    assert image.num_crops == 4 and image.pixel_values.shape == (5, 3, 64, 64) and image.num_tokens == 5 * 16
    text = "<bos>look<start_of_image>what"
    expanded = ours.expand_text(text, [image])
    assert expanded == text.replace("<start_of_image>", reference.replace_image_token({"num_crops": [4]}, 0))
    ids = reference.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    media = ours.crop_media(ids, [image])
    assert [item.num_tokens for item in media] == [16] * 5 and len({item.key for item in media}) == 5
    assert all(set(ids[item.offset : item.offset + 16]) == {ours.image_token_id} for item in media)
    assert all(item.shape == [1, 3, 64, 64] for item in media)
    spliced = ours.splice(reference.tokenizer(text, add_special_tokens=False)["input_ids"], [image], "image_data")
    assert [item.num_tokens for item in ours.crop_media(spliced, [image])] == [16] * 5
    for bad, why in ((lambda: ours.expand_text(text + "<start_of_image>", [image]), "2 image placeholders"),
                     (lambda: ours.settings({"do_pan_and_scan": "yes"}), "do_pan_and_scan"),
                     (lambda: ours.settings({"max_pixels": 5}), "do_pan_and_scan")):
        with pytest.raises(ApiError, match=why):
            bad()
    assert ours.preprocess(_noise(40, 200), WHERE, ours.settings({"do_pan_and_scan": False})).num_crops == 0
