"""SGLang's native API, management routes and Prometheus metrics on the real server."""

from __future__ import annotations

import json
import signal
import threading
import time

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from crane_mp.testing.make_model import make_model
from crane_mp.worker.platforms import platform_for
from tests.integration.server import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model("hunyuan", "tiny", tmp_path_factory.mktemp("m") / "hy", seed=2)
    srv = Server(model, "--max-concurrent", "16", "--health-generate-timeout", "3",
                 log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


def gen(server, body, **kw):
    return requests.post(server.url + "/generate", json=body, timeout=60, **kw)


def test_generate_single_by_text_and_ids(server):
    r = gen(server, {"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    body = r.json()
    assert r.status_code == 200
    count = requests.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()["count"]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == count and meta["completion_tokens"] == len(body["output_ids"]) <= 5
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["e2e_latency"] > 0 and meta["id"]
    assert meta["cached_tokens"] == 0
    by_ids = gen(server, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                        "ignore_eos": True}}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == 3 and len(by_ids["output_ids"]) == 4
    assert by_ids["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_generate_batch_in_input_order_with_logprobs(server):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    body = {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    results = gen(server, body).json()
    assert isinstance(results, list) and len(results) == 3
    singles = [gen(server, {**body, "input_ids": p}).json() for p in prompts]
    for prompt, batched, single in zip(prompts, results, singles):
        assert batched["output_ids"] == single["output_ids"]
        meta = batched["meta_info"]
        assert meta["prompt_tokens"] == len(prompt)
        assert [t[1] for t in meta["input_token_logprobs"]] == prompt and meta["input_token_logprobs"][0][0] is None
        assert [t[1] for t in meta["output_token_logprobs"]] == batched["output_ids"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_stream_sglang_framing(server):
    body = {"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "seed": 3}}
    with gen(server, body, stream=True) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(b["output_ids"][: len(a["output_ids"])] == a["output_ids"] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    whole = gen(server, {**body, "stream": False}).json()
    assert whole["text"] == chunks[-1]["text"] and whole["output_ids"] == chunks[-1]["output_ids"]


def test_abort_request_ends_a_running_stream_and_frees_blocks(server):
    body = {"text": "long", "rid": "my-request-1", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    last = {}
    first_chunk = threading.Event()

    def consume():
        with gen(server, body, stream=True) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    last.update(json.loads(line[6:]))
                    first_chunk.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_chunk.wait(60)
    with server.paused("worker"):  # still running when the abort lands
        assert requests.post(server.url + "/abort_request", json={"rid": "my-request-1"}).json()["success"]
    reader.join(10)
    assert not reader.is_alive()
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1500
    stats = requests.get(server.url + "/server_info").json()["stats"]
    assert stats["kv_blocks_used"] == 0 and stats["active_sequences"] == 0
    assert requests.post(server.url + "/abort_request", json={"rid": "never-existed"}).status_code == 200


def test_management_routes(server):
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(server.url + path).json()
        assert info["device"] == "Cpu" and info["is_generation"] and info["max_context_length"] == 2048
        assert info["model_type"] == "hunyuan" and info["dtype"] == "float32"
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path).json()
        assert info["version"] and info["max_concurrent"] == 16
        assert info["prefix_cache"] is True and info["overlap_schedule"] is True
        assert info["stats"]["kv_blocks_total"] > 0 and info["stats"]["completed_requests"] >= 0
        # The worker's CPU tier, as this process computes it (same CPU, same CRANE_MP_ISA).
        assert (info["isa"], info["kernel_isa"]) == platform_for("cpu").describe()
    assert requests.get(server.url + "/health").json() == {"status": "ok"}
    assert requests.get(server.url + "/health_generate").status_code == 200
    assert requests.post(server.url + "/flush_cache").status_code == 200
    assert requests.get(server.url + "/v1/stats").json()["num_total_blocks"] > 0
    r = gen(server, {"text": "x", "sampling_params": {"max_new_tokens": "many"}})
    assert r.status_code == 400 and r.json()["error"]["param"]
    assert gen(server, {"sampling_params": {}}).status_code == 400
    assert gen(server, {"text": "", "sampling_params": {}}).status_code == 400  # an empty prompt is a client error
    r = gen(server, {"text": "x", "sampling_params": {"stop": ["a"] * 17}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop"


def metric_values(server) -> dict[tuple, float]:
    text = requests.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_metrics_parse_and_count_exactly(server):
    before = metric_values(server)
    workload = [gen(server, {"input_ids": [7] * (3 + i), "sampling_params": {"max_new_tokens": 2 + i,
                                                                              "ignore_eos": True}}).json()
                for i in range(5)]
    after = metric_values(server)
    labels = (("model_name", "hy"), ("replica", f"127.0.0.1:{server.port}"))
    gen_key = ("vllm:generation_tokens_total", labels)
    prompt_key = ("vllm:prompt_tokens_total", labels)
    assert after[gen_key] - before.get(gen_key, 0) == sum(w["meta_info"]["completion_tokens"] for w in workload)
    assert after[prompt_key] - before.get(prompt_key, 0) == sum(w["meta_info"]["prompt_tokens"] for w in workload)
    length_key = ("vllm:request_success_total", (("finished_reason", "length"), *labels))
    assert after[length_key] - before.get(length_key, 0) == 5
    for key, value in before.items():
        if key[0].endswith("_total") or key[0].endswith("_count"):
            assert after[key] >= value  # counters only grow
    assert ("vllm:num_requests_running", labels) in after
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", labels)] <= 1.0
    assert after[("vllm:time_to_first_token_seconds_count", labels)] >= 5


def test_health_generate_is_503_while_the_worker_is_stuck(server):
    worker = psutil.Process(server.pids["worker"])
    worker.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        r = requests.get(server.url + "/health_generate", timeout=30)
        assert r.status_code == 503 and time.monotonic() - start < 10
    finally:
        worker.send_signal(signal.SIGCONT)
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


def flush_when_idle(server) -> None:
    """Flush the prefix cache once the requests of earlier tests (or their aborts) have drained."""
    deadline = time.monotonic() + 30
    while requests.post(server.url + "/flush_cache").status_code != 200:
        assert time.monotonic() < deadline


def test_prefix_cache_reports_cached_tokens_and_flush_drops_it(server):
    prompt = [5 + i % 300 for i in range(40)]  # two full 16-token blocks, and 8 more tokens
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    flush_when_idle(server)
    first = gen(server, body).json()
    assert first["meta_info"]["cached_tokens"] == 0
    again = gen(server, body).json()
    assert again["meta_info"]["cached_tokens"] == 32 and again["output_ids"] == first["output_ids"]
    model = requests.get(server.url + "/v1/models").json()["data"][0]["id"]
    completion = requests.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    metrics = requests.get(server.url + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 64
    assert "vllm:prefix_cache_queries_total" in metrics

    streaming = {**body, "stream": True, "sampling_params": {**body["sampling_params"], "max_new_tokens": 1900}}
    with requests.post(server.url + "/generate", json=streaming, stream=True, timeout=60) as resp:
        lines = resp.iter_lines(chunk_size=1)  # kept: a closed iterator would close the connection
        next(line for line in lines if line)  # the request is running now
        with server.paused("worker"):  # and still running when the flush lands
            refused = requests.post(server.url + "/flush_cache")
        assert refused.status_code == 400 and not refused.json()["success"]
    flush_when_idle(server)  # once the stream's abort has reached the engine
    assert gen(server, body).json()["meta_info"]["cached_tokens"] == 0
