"""Property tests of the frontend in-process (fake scheduler): every body /openapi.json allows is
accepted, and extreme values in any field of any route get a 4xx, never a 5xx, and leave nothing
registered. The real server gets the same treatment, fewer times, in tests/integration."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st
from hypothesis_jsonschema import from_schema
from PIL import Image

from crane_mp.config import EngineConfig
from crane_mp.frontend.openai.schemas import CONSTRAINT_FIELDS
from crane_mp.frontend.openapi import build_openapi
from crane_mp.testing.make_model import make_model
from crane_mp.testing.make_vl import make_vl
from tests.unit.frontend_harness import start_frontend, stop_frontend

MAX_MODEL_LEN = 4096  # room for nearly every prompt hypothesis writes: the window cannot be stated in a schema
# Extreme values for any field: out-of-range integers, floats (inf and nan written as JSON's
# non-standard literals), huge and odd strings, long and deep lists, wrong types.
EXTREMES = st.one_of(
    st.sampled_from([2**64, -(2**64), 2**63, 2**63 - 1, -(2**63), 10**30, 0, -1]),
    st.integers(),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308, -0.0, 5e-324, 0.5]),
    st.sampled_from(["", "x" * 100_000, "\u0000", "\ud7ff\ue000", "²", "-1", "1e5", " 7"]),
    st.text(max_size=50),
    st.sampled_from([[], [0] * 20_000, [[[[]]]], [None], {}, {"a": [1, {"b": None}]}, True, None]),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=5),
)


def _png_data_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# Image parts of chat bodies, as the document allows them (any string is a URL there): a good image, the
# URLs a server must refuse (malformed, another scheme, hosts not allowed: nothing is ever fetched) and
# bad data URLs.
IMAGE_URLS = st.one_of(st.text(max_size=30), st.sampled_from([
    _png_data_url(), "http://[::1/x.png", "http://example.com:99999/x.png", "https://example.com/x.png",
    "http://127.0.0.1:8080/x.png", "ftp://example.com/x.png", "data:image/png;base64,AAAA", "data:text/plain,hi",
]))
IMAGE_PARTS = st.builds(lambda url, detail: {"type": "image_url", "image_url": {"url": url, "detail": detail}},
                        IMAGE_URLS, st.sampled_from([None, "auto", "low", "high"]))


def _post_operations(doc: dict) -> list[tuple[str, dict]]:
    """JSON bodies only (the audio routes' uploads are multipart: tests/unit/test_uploads.py)."""
    return [(path, ops["post"]["requestBody"]["content"]["application/json"]["schema"])
            for path, ops in doc["paths"].items()
            if "post" in ops and "application/json" in ops["post"].get("requestBody", {}).get("content", {})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


def _running(model_dir, run_dir):
    """A frontend driven from a private event loop (hypothesis tests are sync)."""
    loop = asyncio.new_event_loop()
    # Every batch size times every n the document allows; a server's --max-request-generations may
    # be lower, which test_frontend_hardening checks.
    client, state, fake = loop.run_until_complete(start_frontend(model_dir, run_dir, MAX_MODEL_LEN,
                                                                 max_request_generations=64 * 16))
    yield loop, client, state, fake
    loop.run_until_complete(stop_frontend(client, state))
    loop.close()


@pytest.fixture(scope="module")
def running(model_dir, tmp_path_factory):
    yield from _running(model_dir, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def vl_running(tmp_path_factory):
    """A vision-language model's, for chat bodies: their image parts are read, not refused unread."""
    yield from _running(make_vl(tmp_path_factory.mktemp("vl") / "model"), tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def embedding_running(model_dir, tmp_path_factory):
    """The same for a server started with --task embed (only /v1/embeddings serves there)."""
    loop = asyncio.new_event_loop()
    engine = EngineConfig(model_path=str(model_dir), task="embed")
    client, state, fake = loop.run_until_complete(start_frontend(model_dir, tmp_path_factory.mktemp("run"),
                                                                 MAX_MODEL_LEN, engine=engine))
    yield loop, client, state, fake
    loop.run_until_complete(stop_frontend(client, state))
    loop.close()


def _post(running, path: str, raw: bytes) -> tuple[int, str]:
    loop, client, state, fake = running

    async def send():
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        return resp.status, await resp.text()

    return loop.run_until_complete(send())


def _document(running) -> dict:
    loop, client, state, fake = running
    info = state.engine_info
    doc = build_openapi(info.vocab_size, info.max_model_len, hidden_size=info.hidden_size)
    # hypothesis-jsonschema resolves local references against the schema it is given.
    return {path: {**schema, "components": doc["components"]} for path, schema in _post_operations(doc)}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/tokenize", "/v1/detokenize",
                                  "/generate", "/abort_request", "/v1/embeddings", "/v1/responses", "/v1/messages",
                                  "/v1/messages/count_tokens", "/separate_reasoning"])
def test_every_body_the_document_allows_is_accepted(request, path):
    fixture = {"/v1/embeddings": "embedding_running", "/v1/chat/completions": "vl_running"}.get(path, "running")
    running = request.getfixturevalue(fixture)
    schema = _document(running)[path]

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(from_schema(schema), st.lists(IMAGE_PARTS, max_size=3))
    def check(body, images):
        if path.startswith("/v1/messages"):  # a name other than the served one is a 404, as documented
            body["model"] = "tiny"  # (Anthropic's API requires one)
        else:
            body.pop("model", None)
        body.pop("previous_response_id", None)  # must name a stored response
        if path == "/v1/responses":
            body.pop("text", None)  # its format's schema, as response_format's
        for name in CONSTRAINT_FIELDS:  # regexes, grammars, schemas: judged when served (test_structured_routes)
            body.pop(name, None)
        for name in ("json_schema", "regex", "ebnf"):
            (body.get("sampling_params") or {}).pop(name, None)
        body.pop("lora_path", None)  # must name a loaded adapter (tests/integration/test_lora.py)
        # Which keys it takes is the model's image processor's (pixel bounds, or Gemma 3's pan-and-scan):
        # no schema of the route can say; judged with each family in tests/integration/test_vision_language.py.
        body.pop("mm_processor_kwargs", None)
        if body.get("messages") and path == "/v1/chat/completions":  # beside the rare ones from the schema
            _add_parts(body["messages"][-1], images)
        status, text = _post(running, path, json.dumps(body).encode())
        if status == 400 and "context window can take" in text:
            reject()  # a prompt longer than the window (messages, tools and system add up): no schema says so
        if status == 400 and body.get("continue_final_message") and _no_text_to_continue(text):
            reject()  # continuing a final message that holds no text (transformers' own check): no schema says so
        assert status == 200 or status == 400 and _refuses_an_image(body, text), (body, text)

    check()
    assert running[2].client.streams == {}


def test_continuing_a_final_message_without_text_is_a_clean_400(running):
    """What the fuzz met: no schema can say that a continued final message needs text; the template's
    check answers, naming the field, and the frontend goes on serving."""
    video = {"type": "video_url", "video_url": {"url": ""}}
    body = {"messages": [{"role": "tool"}, {"role": "tool", "content": [video]}], "add_generation_prompt": False,
            "continue_final_message": True}
    status, text = _post(running, "/v1/tokenize", json.dumps(body).encode())
    assert status == 400 and _no_text_to_continue(text), text
    body["messages"][-1]["content"] = "go on"
    status, text = _post(running, "/v1/tokenize", json.dumps(body).encode())
    assert status == 200 and json.loads(text)["count"] > 0, text


def _add_parts(message: dict, parts: list[dict]) -> None:
    content = message.get("content")
    if not isinstance(content, list):
        content = [{"type": "text", "text": content}] if isinstance(content, str) else []
    message["content"] = content + parts


def _no_text_to_continue(text: str) -> bool:
    """The answer is the chat template's 400 for continuing a final message with no text in it."""
    error = json.loads(text)["error"]
    return error.get("param") == "messages" and "continue_final_message" in error["message"]


_IMAGE_PART_TYPES = ("image_url", "video_url", "input_image", "image")  # chat's, the Responses API's, Anthropic's


def _refuses_an_image(body: dict, text: str) -> bool:
    """The answer is a 400 naming an image of the body (a part, or SGLang's image_data), or saying the
    model takes none: no schema says what a URL must hold, nor which models take images."""
    parts = [f"{field}[{i}].content[{j}]" for field in ("messages", "input")
             for i, message in enumerate(body.get(field) if isinstance(body.get(field), list) else [])
             if isinstance(message, dict) and isinstance(message.get("content"), list)
             for j, part in enumerate(message["content"])
             if isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES]
    if body.get("image_data"):
        parts.append("image_data")
    error = json.loads(text)["error"]
    message = error["message"]
    if parts and ("takes no images" in message or "takes no videos" in message):
        return True
    return any(message.startswith((f"{where}:", f"{where} ")) or message.endswith(f" at {where}") or
               where == error.get("param") for where in parts)


@pytest.mark.slow  # 300 generated bodies through the whole frontend: the full run's hardening check
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_extreme_values_in_any_field_are_refused_cleanly(running, embedding_running, data):
    documents = _document(running)
    path = data.draw(st.sampled_from(sorted(documents)))
    if path == "/v1/embeddings":
        running = embedding_running
    component = documents[path]["$ref"].rsplit("/", 1)[-1]
    fields = sorted(documents[path]["components"]["schemas"][component]["properties"])
    base = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/tokenize": {"prompt": "hi"},
            "/v1/detokenize": {"tokens": [1]}, "/generate": {"text": "hi"}, "/abort_request": {"rid": "x"},
            "/v1/embeddings": {"input": "hi"}, "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/x"},
            "/v1/unload_lora_adapter": {"lora_name": "a"}, "/v1/responses": {"input": "hi", "max_output_tokens": 2},
            "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            "/separate_reasoning": {"text": "<think>a</think>b"}, "/v1/rerank": {"query": "q", "documents": ["d"]},
            "/score": {"text_1": "q", "text_2": ["d"]}, "/update_weights_from_disk": {"model_path": "nowhere"}}[path]
    body = dict(base)
    for field in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[field] = data.draw(EXTREMES)
    status, text = _post(running, path, json.dumps(body).encode())
    assert status < 500, (path, body, text)
    assert status in (200, 400, 404, 413), (status, text)
    assert running[2].client.streams == {}
