"""Several models behind one port: a chat model, an embedding model and a reranker, each answering its
own routes as its one-model server would (transformers' greedy tokens, sentence-transformers' vectors
and scores), the wrong route a 400, an unknown model a 404, the openai SDK listing all three; then,
with --load-on-demand and a budget that fits two of them, the third evicts the least recently used
idle one, the server's resident memory (every process, sampled every 100 ms) stays within the budget,
and every request is answered by the model it named."""

from __future__ import annotations

import socket
import threading
from datetime import datetime

import numpy as np
import psutil
import pytest
import requests

from crane_mp.testing.make_encoder import make_encoder
from crane_mp.testing.make_model import make_model
from tests.integration.server import Server
from tests.model_helpers import transformers_greedy

QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "rain over the river"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"chat": make_model("qwen3", "tiny", root / "chat", seed=4),
            "embedder": make_encoder("bert", root / "embedder", "embed", "mean", seed=5),
            "ranker": make_encoder("bert", root / "ranker", "score", seed=3)}


def _model_args(checkpoints) -> list[str]:
    return [arg for name, path in checkpoints.items() for arg in ("--model-path", f"{name}={path}")]


def _chat_ids(url: str, prompt_ids: list[int], model: str = "chat") -> list[int]:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = requests.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def all_three(checkpoints, tmp_path_factory):
    """One server with the three models, all loaded at start (no --load-on-demand)."""
    server = Server(None, *_model_args(checkpoints), "--api-key", "secret",
                    log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield server
    assert server.stop() == 0


def test_each_model_answers_its_own_routes(checkpoints, all_three):
    import openai
    from sentence_transformers import CrossEncoder, SentenceTransformer

    prompt = [5, 17, 42, 99, 7]
    want_tokens = transformers_greedy(checkpoints["chat"], [prompt], 8)[0]
    want_vectors = SentenceTransformer(str(checkpoints["embedder"]), device="cpu").encode(DOCUMENTS)
    want_scores = CrossEncoder(str(checkpoints["ranker"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    server = all_three
    headers = {"Authorization": "Bearer secret"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="secret")
    assert sorted(model.id for model in client.models.list()) == ["chat", "embedder", "ranker"]
    assert requests.get(server.url + "/v1/models", timeout=10).status_code == 401

    completion = client.completions.create(model="chat", prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].token_ids == want_tokens
    streamed = client.completions.create(model="chat", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == completion.choices[0].text
    answer = client.responses.create(model="chat", input="hello", max_output_tokens=4)
    assert client.responses.retrieve(answer.id).id == answer.id  # stored by the model that gave it
    vectors = client.embeddings.create(model="embedder", input=DOCUMENTS)
    np.testing.assert_allclose([item.embedding for item in vectors.data], want_vectors, atol=1e-5)
    scored = requests.post(server.url + "/score", headers=headers, timeout=60,
                           json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want_scores.tolist(), abs=1e-4)

    wrong = requests.post(server.url + "/v1/embeddings", headers=headers, timeout=60,
                          json={"model": "chat", "input": "x"})
    assert wrong.status_code == 400 and "--task generate" in wrong.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="nowhere"):
        client.chat.completions.create(model="nowhere", messages=[{"role": "user", "content": "hi"}])
    unnamed = requests.post(server.url + "/v1/embeddings", headers=headers, timeout=60, json={"input": "x"})
    assert unnamed.status_code == 200  # the one embedding model
    metrics = requests.get(server.url + "/metrics", headers=headers, timeout=30).text
    for name in checkpoints:
        assert f'crane:model_state{{model_name="{name}",state="loaded"}} 1.0' in metrics
    assert 'vllm:request_success_total{finished_reason="length",model_name="chat"' in metrics

    slept = requests.post(server.url + "/sleep", params={"model": "ranker", "level": 1}, headers=headers, timeout=60)
    assert slept.status_code == 200, slept.text
    assert {card.id: card.state for card in client.models.list()}["ranker"] == "sleeping"
    again = requests.post(server.url + "/score", headers=headers, timeout=60,
                          json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert again == scored | {"id": again["id"], "created": again["created"]}  # woken, the same scores
    assert requests.post(server.url + "/sleep", headers=headers, timeout=60).status_code == 200  # every model
    assert requests.get(server.url + "/is_sleeping", headers=headers, timeout=60).json()["is_sleeping"] is True
    assert requests.post(server.url + "/wake_up", headers=headers, timeout=60).status_code == 200
    assert set(requests.get(server.url + "/is_sleeping", headers=headers, timeout=60).json()["models"].values()) == {
        "loaded"}


class Notifications:
    """What the server tells systemd, read as it arrives (systemd reads at once: a full queue blocks the sender)."""

    def __init__(self, path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode().split("\n")[0])
            except TimeoutError:
                continue

    def stop(self) -> list[str]:
        self.done.set()
        self.thread.join()
        self.sock.close()
        return self.messages


class MemorySampler:
    """The server's resident memory (every process it started), every 100 ms, on a thread."""

    def __init__(self, server: Server) -> None:
        self.server, self.peak, self.samples = server, 0, 0
        self.peak_at = ""  # when, as the server's log writes times: a failure names the step it came in
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            total = 0
            for process in self.server.process_tree():
                try:
                    total += process.memory_info().rss
                except psutil.Error:
                    continue
            if total > self.peak:
                self.peak, self.peak_at = total, datetime.now().isoformat(" ", "milliseconds").replace(".", ",")
            self.samples += 1

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def _states(url: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in requests.get(url + "/v1/models", timeout=30).json()["data"]}


def _use(url: str, name: str) -> None:
    if name == "chat":
        _chat_ids(url, [5, 6, 7])
    elif name == "embedder":
        assert requests.post(url + "/v1/embeddings", json={"model": name, "input": "x"}, timeout=300).ok
    else:
        assert requests.post(url + "/v1/rerank", json={"model": name, "query": "q", "documents": ["a"]},
                             timeout=300).ok


def test_a_budget_for_two_of_three_evicts_the_least_recently_used(checkpoints, all_three, tmp_path):
    """The budget comes from the footprints the first server measured: room for any two models, not three."""
    info = requests.get(all_three.url + "/server_info", headers={"Authorization": "Bearer secret"}, timeout=30).json()
    footprints = sorted(model["footprint_bytes"] for model in info["models"])
    router = info["resident_bytes"] - sum(footprints)
    budget = (router + footprints[1] + footprints[2] + footprints[0] // 2) // 1024 * 1024
    notify = Notifications(tmp_path / "notify.sock")  # systemd's, as the unit file runs it
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "2000000"}
    server = Server(None, *_model_args(checkpoints), "--load-on-demand", "--gpu-memory-limit", f"{budget // 1024}K",
                    log_path=tmp_path / "server.log", env=env)
    sampler = MemorySampler(server)
    try:
        assert set(_states(server.url).values()) == {"unloaded"}  # nothing pinned: nothing loaded yet
        assert requests.get(server.url + "/favicon.ico", timeout=30).status_code == 404
        asked = requests.get(server.url + "/is_sleeping", params={"model": "ranker"}, timeout=30).json()
        assert asked == {"is_sleeping": False, "level": 0, "state": "unloaded"}
        assert requests.post(server.url + "/sleep", params={"model": "chat"}, timeout=30).status_code == 200
        # No model is loaded for a path none serves, nor to be asked about or put to sleep.
        assert set(_states(server.url).values()) == {"unloaded"}
        want = _chat_ids(server.url, [9, 8, 7])
        _use(server.url, "embedder")
        assert _states(server.url) == {"chat": "loaded", "embedder": "loaded", "ranker": "unloaded"}
        _use(server.url, "ranker")  # the chat model is the least recently used: it goes
        assert _states(server.url) == {"chat": "unloaded", "embedder": "loaded", "ranker": "loaded"}
        assert _chat_ids(server.url, [9, 8, 7]) == want  # loaded again, the embedder evicted
        assert _states(server.url) == {"chat": "loaded", "embedder": "unloaded", "ranker": "loaded"}
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        assert 'crane:model_evictions_total{model_name="chat"} 1.0' in metrics
    finally:
        peak = sampler.stop()
        server.stop()
        messages = notify.stop()
    assert sampler.samples > 10
    lines = (tmp_path / "server.log").read_text(errors="replace").splitlines()
    router_log = "\n".join(line for line in lines if "crane_mp.router" in line)
    assert peak <= budget, (f"resident memory peaked at {peak} over the {budget}-byte budget at {sampler.peak_at}; "
                            f"the router's log:\n{router_log}")
    # Ready once (the models' own launchers tell systemd nothing), pings while the loaded models answer.
    assert messages[0] == "READY=1" and messages.count("READY=1") == 1
    assert messages.count("WATCHDOG=1") >= 2 and messages[-1] == "STOPPING=1"
