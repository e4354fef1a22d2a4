"""Multi-LoRA through the real three processes against PEFT: base-model and two adapters' requests
batched together give exactly PEFT's greedy tokens (also under preemption), the prefix cache never
hands one adapter's KV to another, and clients pick adapters by model name or SGLang's lora_path."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

ADAPTERS = {"all7": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "qv-down": ["q_proj", "v_proj", "down_proj"]}
PROMPTS = [[5, 17, 99, 200, 13] * 8, [44, 45, 46, 47] * 5, [300, 301, 7] * 3]  # the first: 40 tokens, 2 full blocks
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two PEFT adapters with random (non-zero) B matrices, saved as PEFT saves them."""
    root = tmp_path_factory.mktemp("lora")
    for seed, (name, targets) in enumerate(ADAPTERS.items()):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                               LoraConfig(r=8, lora_alpha=16, target_modules=targets, use_rslora=seed == 1))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        model.save_pretrained(str(root / name))
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    """Greedy continuation of each prompt by the base model and by each adapter, in PEFT."""
    out = {}
    for name in (None, *ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name]))
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                 do_sample=False)
            out[name, tuple(prompt)] = ids[0, len(prompt):].tolist()
    return out


def lora_args(adapters) -> list[str]:
    return ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]


async def complete_all(url: str, jobs: list[tuple[str | None, list[int]]]) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async def one(model, prompt):
            body = {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **({"model": model} if model else {})}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        return await asyncio.gather(*(one(model, prompt) for model, prompt in jobs))


def test_mixed_batches_match_peft_also_under_preemption(model_dir, adapters, reference, tmp_path):
    jobs = [(name, prompt) for name in (None, *ADAPTERS) for prompt in PROMPTS]
    for extra in ([], ["--max-total-tokens", "64", "--max-concurrent", "9"]):
        # float32 KV: PEFT's float32 reference, also for the requests recomputed after preemption
        server = Server(model_dir, *lora_args(adapters), "--kv-cache-dtype", "float32", *extra,
                        log_path=tmp_path / f"log{len(extra)}")
        try:
            work = complete_all(server.url, jobs)
            results = asyncio.run(server.all_queued(work, len(jobs)) if extra else work)
            for (name, prompt), result in zip(jobs, results):
                assert result["choices"][0]["token_ids"] == reference[name, tuple(prompt)], (name, prompt)
                assert result["model"] == (name or model_dir.name)
            if extra:
                assert server.stats()["num_preemptions"] > 0
        finally:
            assert server.stop() == 0


def test_prefix_cache_and_names(model_dir, adapters, reference, tmp_path):
    server = Server(model_dir, *lora_args(adapters), "--kv-cache-dtype", "float32", log_path=tmp_path / "log")
    try:
        prompt = PROMPTS[0]
        base, first, again = (asyncio.run(complete_all(server.url, [(m, prompt)]))[0] for m in (None, "all7", "all7"))
        assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The base model's blocks of the same prompt are not the adapter's: nothing cached, exact tokens.
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first["choices"][0]["token_ids"] == reference["all7", tuple(prompt)]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert again["choices"][0]["token_ids"] == reference["all7", tuple(prompt)]

        models = requests.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [model_dir.name, "all7", "qv-down"]
        assert all(m["parent"] == model_dir.name for m in models[1:])
        card = requests.get(server.url + "/v1/models/qv-down").json()
        assert card["root"] == "qv-down" and str(adapters["qv-down"]) not in json.dumps(card)  # no server paths

        body = {"input_ids": PROMPTS[1:], "lora_path": ["qv-down", None],
                "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}}
        outs = requests.post(server.url + "/generate", json=body).json()
        assert outs[0]["output_ids"] == reference["qv-down", tuple(PROMPTS[1])]
        assert outs[1]["output_ids"] == reference[None, tuple(PROMPTS[2])]

        r = requests.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert r.status_code == 404 and "`all7`" in r.json()["error"]["message"]
        r = requests.post(server.url + "/generate", json={"text": "hi", "lora_path": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    finally:
        assert server.stop() == 0


def test_an_adapter_that_cannot_be_served_stops_the_start_with_one_line(model_dir, adapters, tmp_path):
    server = Server(model_dir, "--lora-modules", f"big={adapters['all7']}", "--max-lora-rank", "4",
                    log_path=tmp_path / "log", wait=False)
    assert server.proc.wait(120) != 0
    server.stop()
    log = (tmp_path / "log").read_text()
    assert "LoRA adapter 'big': rank 8 is above --max-lora-rank 4" in log and "Traceback" not in log


def test_adapters_load_and_unload_at_run_time(model_dir, adapters, reference, tmp_path):
    root = adapters["all7"].parent
    server = Server(model_dir, "--enable-runtime-lora", "--lora-root", str(root), "--max-loras", "1",
                    "--kv-cache-dtype", "float32", "--admin-api-key", "admin", log_path=tmp_path / "log")
    url = server.url

    def post(route: str, body: dict) -> requests.Response:
        return requests.post(url + route, json=body, headers={"Authorization": "Bearer admin"})

    try:
        body = {"lora_name": "all7", "lora_path": "all7"}  # relative to --lora-root
        assert requests.post(url + "/v1/load_lora_adapter", json=body).status_code == 401  # the admin key's
        secret = tmp_path / "secret"
        secret.mkdir()
        (secret / "adapter_config.json").write_text('{"peft_type": "TOP-SECRET-VALUE"}')
        (root / "escape").symlink_to(secret)
        for outside in (str(secret), "../" + secret.name, "escape"):
            r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": outside})
            assert r.status_code == 400 and "--lora-root" in r.text and "TOP-SECRET" not in r.text, r.text
            assert r.json()["error"]["param"] == "lora_path"
        prompt = PROMPTS[1]
        loaded = post("/v1/load_lora_adapter", body)
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        [result] = asyncio.run(complete_all(url, [("all7", prompt)]))
        assert result["choices"][0]["token_ids"] == reference["all7", tuple(prompt)]
        assert [m["id"] for m in requests.get(url + "/v1/models").json()["data"]] == [model_dir.name, "all7"]

        for body, status, words in [
            ({"lora_name": "all7", "lora_path": str(adapters["all7"])}, 400, "already loaded"),
            ({"lora_name": "qv-down", "lora_path": str(adapters["qv-down"])}, 400, "--max-loras"),
        ]:
            r = post("/v1/load_lora_adapter", body)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text

        assert post("/v1/unload_lora_adapter", {"lora_name": "all7"}).status_code == 200
        r = post("/v1/completions", {"model": "all7", "prompt": "hi"})
        assert r.status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "all7"}).status_code == 404

        r = post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(root / "missing")})
        assert r.status_code == 400 and "needs adapter_config.json" in r.json()["error"]["message"]
        assert post("/v1/load_lora_adapter", {"lora_name": "qv-down", "lora_path": str(adapters["qv-down"])}).ok
        [result] = asyncio.run(complete_all(url, [("qv-down", prompt)]))
        assert result["choices"][0]["token_ids"] == reference["qv-down", tuple(prompt)]
    finally:
        assert server.stop() == 0


def test_without_the_opt_in_the_run_time_routes_do_not_exist(model_dir, adapters, tmp_path):
    server = Server(model_dir, "--lora-modules", f"all7={adapters['all7']}", log_path=tmp_path / "log")
    try:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = requests.post(server.url + route, json={"lora_name": "qv", "lora_path": str(adapters["qv-down"])})
            assert r.status_code == 404, r.text
            assert route not in requests.get(server.url + "/openapi.json").json()["paths"]
        assert "all7" in [m["id"] for m in requests.get(server.url + "/v1/models").json()["data"]]
    finally:
        assert server.stop() == 0


def test_two_tensor_parallel_ranks_split_adapters_and_load_them_at_run_time(model_dir, adapters, reference, tmp_path):
    """Each rank holds its part of every adapter (B's rows of q/k/v and gate/up, A's columns of o and
    down); one loaded at run time is in place on every rank before a request uses it."""
    root = adapters["all7"].parent
    server = Server(model_dir, "--tensor-parallel-size", "2", "--lora-modules", f"all7={adapters['all7']}",
                    "--enable-runtime-lora", "--lora-root", str(root), "--kv-cache-dtype", "float32",
                    log_path=tmp_path / "log")
    try:
        body = {"lora_name": "qv-down", "lora_path": "qv-down"}
        loaded = requests.post(server.url + "/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        jobs = [(name, prompt) for name in (None, *ADAPTERS) for prompt in PROMPTS]
        for (name, prompt), result in zip(jobs, asyncio.run(complete_all(server.url, jobs))):
            assert result["choices"][0]["token_ids"] == reference[name, tuple(prompt)], (name, prompt)
    finally:
        assert server.stop() == 0
