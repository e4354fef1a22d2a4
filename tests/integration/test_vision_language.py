"""Images in chat through the real server (Qwen2.5-VL, Qwen3-VL and Qwen3.5, tiny random weights): greedy
tokens equal transformers' generate on the processor's inputs for 1-3 images, in a batch with text-only
requests and under preemption; the prefix cache shares blocks of the same image only; bad images are
400s."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import numpy as np
import pytest
import requests
import torch
import transformers
from PIL import Image

from crane_mp.testing.make_vl import FAMILIES, make_vl, reference_processor
from tests.integration.server import Server, free_port

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
_SIZES = [(56, 84), (70, 40), (112, 112), (84, 56)]


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


IMAGES = [_image(i, size) for i, size in enumerate(_SIZES)]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def content(images: list[int], text: str = "what") -> list[dict] | str:
    """The message content: text, and images between "look" and the text (a string without images)."""
    if not images:
        return f"look {text}"
    parts = [{"type": "text", "text": "look"}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(png(IMAGES[i]))}} for i in images]
    return parts + [{"type": "text", "text": text}]


# Each job: (images, closing text); text-only jobs have none.
JOBS = [((0,), "what"), ((1, 2), "what"), ((2, 0, 3), "what"), ((), "what"), ((3,), "else"), ((), "more")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vl(tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return make_vl(tmp_path_factory.mktemp(request.param) / "model", family=request.param)


@pytest.fixture(scope="module")
def reference(family_dir):
    config = transformers.AutoConfig.from_pretrained(family_dir)
    processor = reference_processor(family_dir)
    model = getattr(transformers, config.architectures[0]).from_pretrained(family_dir, dtype=torch.float32).eval()
    out = {}
    for images, text in JOBS:
        parts = content([], text)
        if images:
            parts = [{"type": "text", "text": "look"}, *({"type": "image"} for _ in images),
                     {"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                               tokenize=False)
        inputs = processor(text=[prompt], images=[IMAGES[i] for i in images] or None, return_tensors="pt")
        tokens = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        out[images, text] = tokens[0, inputs["input_ids"].shape[1]:].tolist()
    return out


async def chat_all(url: str, jobs, queued=None) -> list[dict]:
    """Every job's answer; with `queued` (Server.queued), each is sent once the scheduler holds the ones
    before it, so they queue in the jobs' order whatever the images take to decode."""
    async with aiohttp.ClientSession() as session:
        async def one(images, text):
            body = {"messages": [{"role": "user", "content": content(list(images), text)}],
                    "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        tasks = []
        for count, job in enumerate(jobs, 1):
            tasks.append(asyncio.ensure_future(one(*job)))
            if queued is not None:
                await queued(count, tasks[-1])
        return await asyncio.gather(*tasks)


def test_greedy_tokens_equal_transformers_with_images_in_mixed_batches_and_under_preemption(
        family_dir, reference, tmp_path):
    # 16-token steps split every Qwen image's placeholders over steps (Gemma 3's go whole) and start a
    # prompt with few blocks; in the jobs' order two prompts that fit together outgrow the 100-token
    # cache (a preemption).
    server = Server(family_dir, "--max-total-tokens", "100", "--block-size", "4", "--max-concurrent", "6",
                    "--max-num-batched-tokens", "16", log_path=tmp_path / "log")
    try:
        results = asyncio.run(server.all_queued(chat_all(server.url, JOBS, server.queued), len(JOBS)))
        for job, result in zip(JOBS, results):
            assert result["choices"][0]["token_ids"] == reference[job], job
        assert server.stats()["num_preemptions"] > 0
    finally:
        assert server.stop() == 0


def test_the_prefix_cache_shares_blocks_of_the_same_image_only(model_dir, tmp_path):
    server = Server(model_dir, "--block-size", "4", log_path=tmp_path / "log")
    try:
        def cached(images: list[int]) -> int:
            body = {"messages": [{"role": "user", "content": content(images)}], "max_tokens": 2, "temperature": 0}
            usage = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
            return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), usage["prompt_tokens"]

        # auto keeps a media model's KV in its compute dtype, so the default server equals the reference
        assert requests.get(server.url + "/server_info", timeout=10).json()["kv_cache_dtype"] == "float32"
        first, prompt = cached([3])
        again, _ = cached([3])
        other, _ = cached([0])  # the same grid as image 3 (84 x 56 and 56 x 84 transposed: other pixels)
        assert first == 0 and again >= prompt - 4
        # Another image's prompt shares only the blocks before the image (the system prompt, "look").
        assert 0 < other < again - 4
        log = (tmp_path / "log").read_text()
        assert "images=1" in log
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert "crane:request_images_count" in metrics
    finally:
        assert server.stop() == 0


def test_bad_images_are_400s_naming_the_part_and_no_url_is_fetched_unless_allowed(model_dir, tmp_path):
    huge = io.BytesIO()
    Image.new("L", (10000, 5000)).save(huge, "PNG")  # 50 megapixels, 50 kB compressed
    truncated = png(IMAGES[2])[:-200]
    cases = {
        "not an image": data_url(b"hello, world" * 10),
        "truncated": data_url(truncated),
        "50 megapixels": data_url(huge.getvalue()),
        "not base64": "data:image/png;base64,***",
        "a URL not allowed": "http://127.0.0.1:9/cat.png",
        "a file URL": "file:///etc/passwd",
    }
    # Images at most 50176 pixels (256 patches of 14 x 14): the memory plan holds one of 16 x 16 patches.
    server = Server(model_dir, "--max-image-pixels", "20000000", "--mm-processor-kwargs", '{"max_pixels": 50176}',
                    log_path=tmp_path / "log")
    try:
        for name, url in cases.items():
            parts = content([0]) + [{"type": "image_url", "image_url": {"url": url}}]
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
            resp = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert resp.status_code == 400, (name, resp.text)
            assert "messages[0].content[3]" in resp.json()["error"]["message"], (name, resp.text)
            if name == "50 megapixels":  # refused by its header's size, before any pixel is decoded
                assert "pixels" in resp.json()["error"]["message"], resp.text
        ok = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content([1])}], "max_tokens": 2})
        assert ok.status_code == 200  # the server kept serving
        assert "largest image: 16 x 16 patches" in (tmp_path / "log").read_text()
    finally:
        assert server.stop() == 0


def test_urls_from_an_allowed_host_are_fetched(model_dir, tmp_path):
    from aiohttp import web

    served = []

    async def image(request):
        served.append(request.path)
        return web.Response(body=png(IMAGES[0]), content_type="image/png")

    async def run() -> tuple[int, list]:
        app = web.Application()
        app.router.add_get("/cat.png", image)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with aiohttp.ClientSession() as session:
                statuses = []
                for url in (f"http://localhost:{port}/cat.png", f"http://127.0.0.1:{port}/cat.png"):
                    body = {"messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what"}]}],
                        "max_tokens": 2}
                    async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
                        statuses.append(resp.status)
                return statuses
        finally:
            await runner.cleanup()

    port = free_port()
    # localhost is a loopback address, fetched only when the operator says so.
    server = Server(model_dir, "--allowed-media-domains", "localhost", "--allowed-media-ports", str(port),
                    "--allow-private-media-addresses", log_path=tmp_path / "log")
    try:
        assert asyncio.run(run()) == [200, 400]  # 127.0.0.1 is not a name the flag allows
        assert served == ["/cat.png"]
    finally:
        assert server.stop() == 0


def test_the_same_images_give_the_same_tokens_through_every_api(model_dir, tmp_path):
    """Chat (the openai SDK), Responses (input_image), Anthropic Messages (the anthropic SDK; base64
    and URL sources) and SGLang /generate (image_data at the prompt's image tokens): one answer. A
    request's mm_processor_kwargs shrinks its images, never above the server's bounds."""
    import anthropic
    import openai
    from aiohttp import web

    encoded = [base64.b64encode(png(IMAGES[i])).decode() for i in (1, 2)]
    port = free_port()
    server = Server(model_dir, "--allowed-media-domains", "localhost", "--allowed-media-ports", str(port),
                    "--allow-private-media-addresses", log_path=tmp_path / "log")

    async def picture(request):
        return web.Response(body=png(IMAGES[2]), content_type="image/png")

    async def serve_picture_and_ask_anthropic(model: str) -> tuple[object, int]:
        app = web.Application()
        app.router.add_get("/two.png", picture)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            client = anthropic.AsyncAnthropic(base_url=server.url, api_key="none")
            greedy = {"temperature": 0}  # this SDK's create() names no temperature
            message = await client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body=greedy, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded[0]}},
                    {"type": "image", "source": {"type": "url", "url": f"http://localhost:{port}/two.png"}},
                    {"type": "text", "text": "what"}]}])
            counted = await client.messages.count_tokens(model=model, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded[0]}},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded[1]}},
                    {"type": "text", "text": "what"}]}])
            return message, counted.input_tokens
        finally:
            await runner.cleanup()

    try:
        model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        chat = openai.OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions.create(
            model=model, messages=[{"role": "user", "content": content([1, 2])}], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"return_token_ids": True, "min_tokens": MAX_TOKENS})
        expected, prompt_tokens = chat.choices[0].token_ids, chat.usage.prompt_tokens
        text = chat.choices[0].message.content
        response = openai.OpenAI(base_url=server.url + "/v1", api_key="none").responses.create(
            model=model, max_output_tokens=MAX_TOKENS, temperature=0, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                *({"type": "input_image", "image_url": data_url(png(IMAGES[i]))} for i in (1, 2)),
                {"type": "input_text", "text": "what"}]}])
        message, counted = asyncio.run(serve_picture_and_ask_anthropic(model))
        prompt = requests.post(server.url + "/tokenize", timeout=30, json={
            "messages": [{"role": "user", "content": content([1, 2])}]}).json()
        generated = requests.post(server.url + "/generate", timeout=60, json={
            "input_ids": prompt["tokens"], "image_data": [encoded[0], data_url(png(IMAGES[2]))],
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}).json()
        smaller, refused = (requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content([1, 2])}], "max_tokens": 1,
            "mm_processor_kwargs": {"max_pixels": pixels}}) for pixels in (56 * 56, 10**9))
        wrong = requests.post(server.url + "/generate", timeout=30, json={
            "text": "no image token here", "image_data": encoded[0], "sampling_params": {"max_new_tokens": 2}})
    finally:
        assert server.stop() == 0
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens
    assert message.content[0].text == text and counted == prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens  # Anthropic's split
    assert generated["output_ids"] == expected and generated["meta_info"]["prompt_tokens"] == prompt_tokens
    assert wrong.status_code == 400 and "image_data" in wrong.text and "<|image_pad|>" in wrong.text
    assert smaller.json()["usage"]["prompt_tokens"] < prompt_tokens  # each image resized to at most 2 x 2 tokens
    assert refused.status_code == 400 and "mm_processor_kwargs.max_pixels" in refused.text


def _pan_and_scan_inputs(processor, prompt: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """What Gemma3Processor gives generate for images its image processor pans and scans (as the
    checkpoint's preprocessor_config asks), from its own parts: transformers 5's processor call drops
    the request for crops."""
    pixels = processor.image_processor(images=images, return_tensors="pt")
    pieces = prompt.split(processor.boi_token)
    text = pieces[0] + "".join(processor.replace_image_token({"num_crops": [int(crops)]}, 0) + piece
                               for crops, piece in zip(pixels["num_crops"], pieces[1:]))
    ids = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels["pixel_values"],
            "token_type_ids": (ids == processor.tokenizer.image_token_id).long()}


def test_gemma3_pan_and_scan_crops_and_images_attended_both_ways_equal_transformers(tmp_path):
    """A Gemma 3 checkpoint whose processor pans and scans: a wide image becomes the whole one and its
    crops, each its own run of soft tokens, in text the processor writes. Tokens and the first token's
    top logprobs equal transformers' (within 2e-5), which tells an image attended both ways from one
    attended causally (off by 4e-4 and more among them in this model) as greedy tokens alone may not."""
    model_dir = make_vl(tmp_path / "gemma3", family="gemma3", pan_and_scan=True)
    processor = reference_processor(model_dir)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    wide = _image(7, (40, 200))
    cases = [[wide], [IMAGES[2], wide]]
    expected = []
    for images in cases:
        parts = [{"type": "text", "text": "look"}, *({"type": "image"} for _ in images), {"type": "text", "text": "hm"}]
        prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                               tokenize=False)
        inputs = _pan_and_scan_inputs(processor, prompt, images)
        tokens = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        with torch.no_grad():
            both_ways = model(**inputs).logits[0, -1].log_softmax(-1)
            causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0, -1].log_softmax(-1)
        top = both_ways.topk(5).indices
        assert (both_ways[top] - causal[top]).abs().max() > 4e-4  # the check below can tell them apart
        expected.append((tokens[0, inputs["input_ids"].shape[1]:].tolist(), inputs["input_ids"].shape[1],
                         both_ways[top].tolist()))
    assert expected[0][1] > 5 * 16  # the wide image's four crops took their soft tokens
    server = Server(model_dir, "--max-num-batched-tokens", "32", log_path=tmp_path / "log")
    try:
        for images, (tokens, prompt_tokens, logprobs) in zip(cases, expected):
            parts = [{"type": "text", "text": "look"},
                     *({"type": "image_url", "image_url": {"url": data_url(png(image))}} for image in images),
                     {"type": "text", "text": "hm"}]
            answer = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "min_tokens": 6, "temperature": 0,
                "return_token_ids": True, "logprobs": True, "top_logprobs": 5}).json()
            assert answer["choices"][0]["token_ids"] == tokens and answer["usage"]["prompt_tokens"] == prompt_tokens
            ours = [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
            assert len(ours) == 5 and all(abs(a - b) < 2e-5 for a, b in zip(ours, logprobs)), (ours, logprobs)
    finally:
        assert server.stop() == 0


def test_a_video_and_an_image_in_one_request_equal_transformers_on_our_frames(tmp_path):
    """Qwen3-VL: a video (sampled, sized and timed by Qwen3VLVideoProcessor's rules: tests/unit/test_video.py)
    beside an image. transformers' generate on the same frames and the text Qwen3VLProcessor writes for
    them (each frame pair's timestamp, then its placeholders) gives the same tokens; a video longer than
    --max-video-seconds is refused from its header."""
    from crane_mp.frontend.images.video import VideoLimits, VideoSettings, decode_video, preprocess_video, video_text
    from crane_mp.testing.make_vl import make_video  # PyAV: imported by the tests that write videos

    model_dir = make_vl(tmp_path / "qwen3_vl", family="qwen3_vl")
    clip = make_video(12, 4, 64, 96)
    settings = VideoSettings.of_checkpoint(model_dir)
    video = preprocess_video(*decode_video(clip, settings, VideoLimits(300, 256, 1 << 25), "v"), settings)
    processor = reference_processor(model_dir)
    parts = [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "what"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=False)
    image = processor.image_processor(images=[IMAGES[1]], return_tensors="pt")
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * int(image["image_grid_thw"].prod() // 4))
    written = video_text(video, 2, "<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
    prompt = prompt.replace("<|video_pad|>", written)
    ids = processor.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    kinds = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=image["pixel_values"],
        image_grid_thw=image["image_grid_thw"], pixel_values_videos=torch.from_numpy(video.pixel_values),
        video_grid_thw=torch.tensor([video.grid_thw]), mm_token_type_ids=kinds, max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    server = Server(model_dir, "--max-num-batched-tokens", "16", "--max-video-seconds", "60",
                    log_path=tmp_path / "log")

    def ask(clip_bytes: bytes) -> requests.Response:
        url = "data:video/mp4;base64," + base64.b64encode(clip_bytes).decode()
        content = [{"type": "text", "text": "look"},
                   {"type": "image_url", "image_url": {"url": data_url(png(IMAGES[1]))}},
                   {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what"}]
        return requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True})

    try:
        answer = ask(clip).json()
        long = ask(make_video(300, 4, 32, 32))  # 75 s
    finally:
        assert server.stop() == 0
    assert answer["choices"][0]["token_ids"] == expected and answer["usage"]["prompt_tokens"] == ids.shape[1]
    assert long.status_code == 400 and "--max-video-seconds" in long.text and "messages[0].content[2]" in long.text
