"""Replicas behind sglang-router, as docs/operations.md deploys them: two servers on loopback and the
router's cache-aware policy. Every API the router forwards works through it unchanged (it writes
SGLang's own fields into the bodies it forwards), each replica's metrics carry its --replica-name,
requests sharing a long prefix find it cached on the replica that served it first, and a replica
killed outright costs no request sent after it died."""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server, free_port

WORDS = "alpha beta gamma delta river stone light city north south market bread".split()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    model_dir = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=4)
    logs = tmp_path_factory.mktemp("logs")
    servers = []
    try:
        for name in ("a", "b"):
            servers.append(Server(model_dir, "--replica-name", name, log_path=logs / f"{name}.log"))
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "cache_aware", "--prometheus-port", str(free_port()), "--worker-urls",
               *(server.url for server in servers)]
        with open(logs / "router.log", "wb") as log:
            router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for_workers(url, router, logs / "router.log")
            yield url, servers
        finally:
            router.terminate()
            router.wait(30)
    finally:
        for server in servers:
            server.kill_all()


def _wait_for_workers(url: str, router: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert router.poll() is None, log.read_text()[-2000:]
        try:
            if requests.get(url + "/v1/models", timeout=5).json().get("data"):
                return
        except (requests.ConnectionError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("the router registered no worker in 120 s:\n" + log.read_text()[-2000:])


def test_every_route_works_through_the_router(replicas):
    url, servers = replicas
    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    whole = requests.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = requests.post(url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"]
    completion = requests.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 5},
                               timeout=60)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 5
    generated = requests.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5}},
                              timeout=60)
    assert generated.status_code == 200 and generated.json()["meta_info"]["completion_tokens"] == 5
    response = requests.post(url + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 5},
                             timeout=60)
    assert response.status_code == 200 and response.json()["object"] == "response"
    served = [requests.get(server.url + "/metrics", timeout=10).text for server in servers]
    assert sum(text.count('vllm:request_success_total{finished_reason="length",model_name="qwen3",replica="')
               for text in served) >= 1
    assert all(f'replica="{name}"' in text for name, text in zip("ab", served))
    [load] = requests.get(servers[0].url + "/get_load", timeout=10).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == load["num_waiting_reqs"] == load["num_tokens"] == 0
    loads = requests.get(url + "/get_loads", timeout=10).json()["workers"]  # the router reads them too
    assert sorted(entry["load"] for entry in loads) == [0, 0]


def test_a_shared_prefix_is_served_from_the_cache_of_one_replica(replicas):
    url, _ = replicas
    rng = random.Random(1)
    prefixes = [" ".join(rng.choices(WORDS, k=330)) for _ in range(4)]  # 1,000+ tokens each

    def ask(i: int) -> dict:
        body = {"text": f"{prefixes[i % 4]} question {i}", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        answer = requests.post(url + "/generate", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["meta_info"]

    first = [ask(i) for i in range(4)]
    assert min(info["prompt_tokens"] for info in first) >= 1000
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        later = list(pool.map(ask, range(4, 44)))
    assert sum(info["cached_tokens"] >= 900 for info in later) >= 0.9 * len(later)


def test_a_replica_killed_outright_costs_no_later_request(replicas):
    url, servers = replicas
    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    victim = servers[1]
    children = [psutil.Process(pid) for pid in victim.pids.values()]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    psutil.wait_procs(children, timeout=30)

    def ask(i: int) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}
        return requests.post(url + "/v1/chat/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(ask, range(32)))
    assert statuses == [200] * 32
