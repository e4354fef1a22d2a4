"""Image URLs fetched by a vision-language model's frontend (fake scheduler) from a local server: the
whole body however it is chunked, within the byte limit, from allowed ports and public addresses only
(loopback here needs the operator's explicit allow), resolved once, and every failure a 400 naming the
part without the remote's words; a malformed URL is a 400 too."""

from __future__ import annotations

import io
import socket

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from crane_mp.frontend.images.fetch import is_public_address
from crane_mp.testing.make_vl import make_vl
from tests.unit.frontend_harness import start_frontend, stop_frontend

LIMIT = 8 << 20  # --max-request-bytes: the fetch's byte limit too


def _noise_png(side: int) -> bytes:
    buf = io.BytesIO()  # noise does not compress: 3 bytes per pixel
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what"}]}], "max_tokens": 2}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_vl(tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture
async def images():
    """A local image server: /big.png (3 MB in 4 KiB writes), /huge (LIMIT + 1 bytes), /gone (a 404 with
    words of its own); `served` lists the paths it was asked for."""
    served, big = [], _noise_png(1000)

    async def chunked(request: web.Request, body: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        for start in range(0, len(body), 4096):
            await response.write(body[start : start + 4096])
        await response.write_eof()
        return response

    async def serve(request: web.Request) -> web.StreamResponse:
        served.append(request.path)
        if request.path == "/gone":
            return web.Response(status=404, text="secret internal detail")
        return await chunked(request, big if request.path == "/big.png" else bytes(LIMIT + 1))

    app = web.Application()
    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1], served, len(big)
    await runner.cleanup()


async def _post(vl_dir, tmp_path, body: dict, **config) -> tuple[int, str, list]:
    client, state, fake = await start_frontend(vl_dir, tmp_path, max_request_bytes=LIMIT, **config)
    try:
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status, await resp.text(), fake.requests
    finally:
        await stop_frontend(client, state)


async def test_an_image_in_many_small_chunks_is_read_whole_and_within_the_limit(vl_dir, tmp_path, images):
    port, served, size = images
    assert size > 3_000_000
    allow = {"allowed_media_domains": ("127.0.0.1",), "allowed_media_ports": (port,),
             "allow_private_media_addresses": True}
    status, text, sent = await _post(vl_dir, tmp_path, _chat(f"http://127.0.0.1:{port}/big.png"), **allow)
    assert status == 200, text
    assert [item.kind for item in sent[0].media] == ["image"]
    status, text, _ = await _post(vl_dir, tmp_path, _chat(f"http://127.0.0.1:{port}/huge"), **allow)
    assert status == 400 and f"messages[0].content[0]: the image is larger than {LIMIT} bytes" in text


async def test_a_name_that_resolves_to_loopback_is_fetched_only_when_allowed(vl_dir, tmp_path, images, monkeypatch):
    port, served, _ = images
    lookups = []
    resolve = socket.getaddrinfo

    def counted(host, *args, **kwargs):
        lookups.append(host)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    body, allow = _chat(f"http://localhost:{port}/big.png"), {"allowed_media_domains": ("localhost",),
                                                               "allowed_media_ports": (port,)}
    status, text, _ = await _post(vl_dir, tmp_path, body, **allow)
    assert status == 400 and "could not fetch the image at messages[0].content[0]" in text
    assert served == []  # refused before connecting
    lookups.clear()
    status, text, _ = await _post(vl_dir, tmp_path, body, allow_private_media_addresses=True, **allow)
    assert status == 200, text
    assert served == ["/big.png"] and lookups.count("localhost") == 1  # the connection used the checked address


async def test_the_remote_answer_is_not_repeated_to_the_client(vl_dir, tmp_path, images):
    port, served, _ = images
    status, text, _ = await _post(vl_dir, tmp_path, _chat(f"http://127.0.0.1:{port}/gone"),
                                  allowed_media_domains=("127.0.0.1",), allowed_media_ports=(port,),
                                  allow_private_media_addresses=True)
    assert status == 400 and "could not fetch the image at messages[0].content[0]" in text
    assert served == ["/gone"] and "404" not in text and "secret" not in text


@pytest.mark.parametrize("url, reason", [
    ("http://[::1/x.png", "malformed"),
    ("http://images.example:99999/x.png", "malformed"),
    ("http://images.example:8080/x.png", "--allowed-media-ports"),
    ("ftp://images.example/x.png", "data: URL or http(s)"),
    ("http://other.example/x.png", "--allowed-media-domains"),
])
async def test_a_url_not_fetched_is_a_400_naming_the_part(vl_dir, tmp_path, url, reason):
    status, text, sent = await _post(vl_dir, tmp_path, _chat(url), allowed_media_domains=("images.example",))
    assert status == 400 and "messages[0].content[0]" in text and reason in text, text
    assert sent == []


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("192.168.0.1", False), ("172.16.0.1", False),
    ("169.254.169.254", False), ("fd00:ec2::254", False), ("192.0.0.192", False), ("100.100.100.200", False),
    ("fe80::1", False), ("0.0.0.0", False), ("::", False), ("224.0.0.1", False), ("ff02::1", False),
    ("240.0.0.1", False), ("255.255.255.255", False),
    ("::ffff:127.0.0.1", False), ("64:ff9b::7f00:1", False), ("2002:a9fe:a9fe::1", False),
])
def test_only_public_addresses_count_as_public(address, public):
    assert is_public_address(address) is public
