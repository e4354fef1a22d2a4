"""Sleep, wake-up and new weights on a running server: /sleep frees the worker's KV cache (level 1) and
its weights too (level 2), the next request wakes it and gets the same tokens; --sleep-idle-seconds
sleeps by itself; /update_weights_from_disk swaps in new weights while streams run, each stream
entirely from the old or entirely from the new weights, and a bad path or shape leaves the old serving."""

from __future__ import annotations

import concurrent.futures
import json
import time

import psutil
import pytest
import requests

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

PROMPTS = ["river stone light", "north market bread", "alpha beta gamma", "city south delta"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    # Eight KV heads: 16 KiB of KV a token, so a few thousand tokens are tens of MiB, well above noise.
    heads = {"num_key_value_heads": 8}
    old = make_model("qwen3", "small", root / "old", seed=4, overrides=heads)
    new = make_model("qwen3", "small", root / "new", seed=5, overrides=heads)
    other = make_model("qwen3", "tiny", root / "other", seed=4)
    return old, new, other


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    # The host's memory is what these sleeps are measured by (on CUDA: tests/gpu/test_cuda_residency.py).
    # Two frontends: a sleep asked of one is read back from either.
    server = Server(checkpoints[0], "--cpu", "--num-frontends", "2", "--max-total-tokens", "4096",
                    "--max-seq-len", "512", log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield server
    server.stop()


def _complete(server: Server, prompt: str, max_tokens: int = 12) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    response = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _stream(server: Server, prompt: str, max_tokens: int = 24) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    text = ""
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=300) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += "".join(choice["text"] for choice in event["choices"])
    return text


def _worker_rss(server: Server) -> int:
    return psutil.Process(server.pids["worker"]).memory_info().rss


def _is_sleeping(server: Server) -> dict:
    return requests.get(server.url + "/is_sleeping", timeout=10).json()


def _model_state(server: Server) -> str:
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["state"]


def _fill_kv(server: Server, num_requests: int, prompt_len: int) -> int:
    """Tokens whose KV these concurrent requests write (the CPU's KV cache is resident once written)."""
    prompts = [[(i * 31 + j * 7) % 8000 + 10 for j in range(prompt_len)] for i in range(num_requests)]
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        list(pool.map(lambda prompt: requests.post(server.url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 8, "ignore_eos": True}).raise_for_status(), prompts))
    return num_requests * (prompt_len + 8)


def test_sleep_frees_kv_then_weights_and_wakes_with_the_same_tokens(server):
    expected = _complete(server, PROMPTS[0])
    info = requests.get(server.url + "/server_info", timeout=10).json()
    written_kv = _fill_kv(server, 7, 480) * info["kv_bytes_per_token"]
    awake = _worker_rss(server)

    response = requests.post(server.url + "/sleep", params={"level": 1}, timeout=120)
    assert response.status_code == 200, response.text
    assert _is_sleeping(server) == {"is_sleeping": True, "level": 1}
    assert _model_state(server) == "sleeping"
    assert awake - _worker_rss(server) >= 0.9 * written_kv

    assert _complete(server, PROMPTS[0]) == expected  # the request wakes the model
    assert _is_sleeping(server)["is_sleeping"] is False
    assert _model_state(server) == "loaded"

    awake = _worker_rss(server)
    assert requests.post(server.url + "/sleep", params={"level": 2}, timeout=120).status_code == 200
    assert _is_sleeping(server) == {"is_sleeping": True, "level": 2}
    assert awake - _worker_rss(server) >= 0.9 * info["weights_bytes"]

    assert requests.post(server.url + "/wake_up", timeout=600).status_code == 200
    assert _is_sleeping(server)["is_sleeping"] is False
    assert _complete(server, PROMPTS[0]) == expected


def test_sleep_is_refused_while_a_request_runs(server):
    _complete(server, PROMPTS[1], 1)  # the worker's sockets are connected before it is frozen
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with server.paused("worker"):
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=300) as stream:
            refused = requests.post(server.url + "/sleep", params={"level": 1}, timeout=30)
            stream.close()
    assert refused.status_code == 409, refused.text
    assert "running" in refused.json()["error"]["message"]
    server.wait_idle()
    bad = requests.post(server.url + "/sleep", params={"level": 3}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"


def test_new_weights_must_lie_under_the_root_and_fit_the_model(server, checkpoints, tmp_path):
    before = _complete(server, PROMPTS[2])
    outside = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=60)
    assert outside.status_code == 400 and "weights root" in outside.json()["error"]["message"]
    missing = requests.post(server.url + "/update_weights_from_disk",
                            json={"model_path": str(checkpoints[0].parent / "nowhere")}, timeout=60)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    shaped = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(checkpoints[2])},
                           timeout=300)
    assert shaped.status_code == 400 and shaped.json()["success"] is False
    assert "shape" in shaped.json()["message"]
    assert _complete(server, PROMPTS[2]) == before  # the old weights still serve


def test_new_weights_swap_in_while_streams_run(server, checkpoints):
    old_path, new_path, _ = checkpoints
    old = {prompt: _stream(server, prompt) for prompt in PROMPTS}

    def client(index: int) -> list[tuple[str, str]]:
        return [(prompt, _stream(server, prompt)) for prompt in (PROMPTS[index % 4], PROMPTS[(index + 1) % 4])]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(client, index) for index in range(8)]
        reload = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(new_path)},
                               timeout=900)
        streamed = [item for future in clients for item in future.result()]
    assert reload.status_code == 200 and reload.json()["success"] is True, reload.text
    new = {prompt: _stream(server, prompt) for prompt in PROMPTS}
    assert all(old[prompt] != new[prompt] for prompt in PROMPTS), (old, new)
    for prompt, text in streamed:
        assert text in (old[prompt], new[prompt]), (prompt, text)
    requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(old_path)}, timeout=900)
    assert {prompt: _stream(server, prompt) for prompt in PROMPTS} == old


def test_idle_sleep_and_wake(checkpoints, tmp_path):
    server = Server(checkpoints[2], "--sleep-idle-seconds", "1", "--sleep-level", "2", log_path=tmp_path / "log")
    try:
        expected = _complete(server, PROMPTS[3])
        deadline = time.monotonic() + 60
        while not _is_sleeping(server)["is_sleeping"]:
            assert time.monotonic() < deadline, "the model never fell asleep"
            time.sleep(0.1)
        assert _is_sleeping(server)["level"] == 2
        assert _complete(server, PROMPTS[3]) == expected
    finally:
        server.stop()
