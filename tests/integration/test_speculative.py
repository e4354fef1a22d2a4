"""Speculative decoding on the real server: a draft model's server answers every request as the same
server without speculation does (greedy, seeded sampling, stop strings matched by the frontend in tokens
that arrive several a step, a regex, streams), under preemption, and reports its acceptance in /metrics;
flags it cannot serve are refused at start with the flag named."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.testing.make_zoo import make_zoo_model
from tests.integration.server import Server

# float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one.
TIGHT = ("--max-total-tokens", "128", "--max-seq-len", "128", "--kv-cache-dtype", "float32", "--max-concurrent", "16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=3)


def serve(model, tmp_path_factory, *args: str) -> Server:
    return Server(model, *TIGHT, *args, log_path=tmp_path_factory.mktemp("log") / "server.log")


# First in every batch: two 40-token prompts asking for 60 greedy tokens, 7 of the 8 KV blocks each at
# the end. Started together (Server.in_waves), they cannot both finish without a preemption.
LONG = 2


def calls(server: Server, stops: list[str]) -> list[Callable[[], dict]]:
    """The two long requests, then 16 mixed ones through SGLang's /generate; the stop strings, where not
    empty, end the greedy requests that ask for them."""
    gen = torch.Generator().manual_seed(5)
    bodies = [{"input_ids": torch.randint(3, 500, (40,), generator=gen).tolist(),
               "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}
              for _ in range(LONG)]
    for i in range(16):
        kind = i % 4
        if kind == 0:
            params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
        elif kind == 1:
            params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True,
                      **({"stop": [stops[i]]} if stops else {})}
        elif kind == 2:
            params = {"max_new_tokens": 20, "temperature": 0.8, "sampling_seed": i, "ignore_eos": True}
        else:
            params = {"max_new_tokens": 20, "temperature": 0, "regex": "(yes|no)-[0-9]{2,3}"}
        bodies.append({"text": " ".join(["echo", "alpha", "beta", str(i)] * (1 + i % 3)), "sampling_params": params})

    def one(body: dict) -> dict:
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    return [partial(one, body) for body in bodies]


def answers(server: Server, stops: list[str]) -> list[dict]:
    """Every call's answer, all sent at once: batched, and preempting each other."""
    todo = calls(server, stops)
    with ThreadPoolExecutor(len(todo)) as pool:
        return list(pool.map(lambda call: call(), todo))


def stream_text(server: Server, stop: str) -> str:
    body = {"prompt": "echo alpha beta echo alpha beta", "max_tokens": 24, "temperature": 0, "stop": [stop],
            "stream": True}
    text = ""
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line and line != b"data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    base = serve(model, tmp_path_factory)
    try:
        free = answers(base, [])[LONG:]
        # Stop strings each greedy request meets: a piece of its own text without one.
        stops = [out["text"][len(out["text"]) // 2 :][:3] for out in free]
        yield stops, answers(base, stops), stream_text(base, stops[1])
    finally:
        assert base.stop() == 0


def test_a_draft_models_server_answers_as_the_server_without_it(model, reference, tmp_path_factory):
    stops, want, want_stream = reference
    spec = serve(model, tmp_path_factory, "--speculative-model", str(model), "--speculative-num-tokens", "4",
                 "--speculative-disable-batch-size", "32")
    try:
        todo = calls(spec, stops)
        got = asyncio.run(spec.in_waves([todo[:LONG], todo[LONG:]]))
        assert [out["output_ids"] for out in got] == [out["output_ids"] for out in want]
        assert [out["text"] for out in got] == [out["text"] for out in want]
        mixed = got[LONG:]
        assert any(out["meta_info"]["finish_reason"]["type"] == "stop" for out in mixed[1::4])  # stop strings met
        # SGLang's count of verifying steps: each greedy request gained several tokens in some of its steps.
        assert all(out["meta_info"]["spec_verify_ct"] < out["meta_info"]["completion_tokens"]
                   for out in got[:LONG] + mixed[::4])
        assert "spec_verify_ct" not in want[0]["meta_info"]
        assert stream_text(spec, stops[1]) == want_stream
        assert spec.stats()["num_preemptions"] > 0  # the two long requests
        families = {f.name: f for f in text_string_to_metric_families(requests.get(spec.url + "/metrics").text)}
        values = {name: sum(s.value for s in families[name].samples if s.name.endswith("_total"))
                  for name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
        assert 0 < values["vllm:spec_decode_num_accepted_tokens"] <= values["vllm:spec_decode_num_draft_tokens"]
        per_position = [s for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
                        if s.name.endswith("_total")]
        assert sorted(s.labels["position"] for s in per_position) == ["0", "1", "2", "3"]
    finally:
        assert spec.stop() == 0


def test_a_prediction_layer_s_server_answers_as_the_model_without_it(tmp_path_factory):
    """--speculative-method mtp on a DeepSeek-V3 checkpoint's prediction layer: the server's greedy tokens,
    under preemption, are the engine's without speculation; /metrics counts the proposals."""
    path = make_zoo_model("deepseek_v3", tmp_path_factory.mktemp("m") / "deepseek_v3", seed=4, prediction_layer=True)
    gen = torch.Generator().manual_seed(2)
    # The first two (7 of the 8 KV blocks each at the end) start together and cannot both finish unpreempted.
    lengths, news = (40, 40, 30, 7, 45, 18, 26, 11, 38, 4), (60, 60, 20, 20, 20, 20, 20, 20, 20, 20)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in news]
    want = LLMEngine(EngineConfig(model_path=str(path), dtype="float32", kv_cache_dtype="float32", force_cpu=True,
                                  max_model_len=128)).generate(prompts, params)
    spec = serve(path, tmp_path_factory, "--speculative-method", "mtp", "--speculative-num-tokens", "3",
                 "--speculative-disable-batch-size", "32")
    try:
        def one(prompt: list[int], max_new: int) -> list[int]:
            r = requests.post(spec.url + "/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        todo = [partial(one, prompt, n) for prompt, n in zip(prompts, news)]
        assert asyncio.run(spec.in_waves([todo[:2], todo[2:]])) == want
        assert spec.stats()["num_preemptions"] > 0  # the two long requests
        families = {f.name: f for f in text_string_to_metric_families(requests.get(spec.url + "/metrics").text)}
        assert sum(s.value for s in families["vllm:spec_decode_num_draft_tokens"].samples) > 0
    finally:
        assert spec.stop() == 0


@pytest.mark.parametrize("flags, message", [
    (["--speculative-method", "draft"], "needs --speculative-model"),
    (["--speculative-method", "mtp"], "has no multi-token-prediction layer"),
    (["--speculative-method", "ngram", "--speculative-ngram-min", "5", "--speculative-ngram-max", "3"],
     "--speculative-ngram-min"),
    (["--speculative-method", "ngram", "--task", "embed"], "--task generate"),
])
def test_speculation_flags_it_cannot_serve_are_refused_at_start(model, flags, message):
    run = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(model), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
