"""--tensor-parallel-size 2 on CPU (gloo): two worker ranks serve the same greedy tokens as transformers
(float32) on every architecture, also under preemption, with the prefix cache and from a Q4_K_M GGUF
file; each rank holds about half the weights; two "nodes" on this host serve the same tokens as one;
a rank killed with SIGKILL fails every open stream and stops the server (non-zero) within 10 s."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import aiohttp
import psutil
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from crane_mp.testing.make_gguf import make_gguf
from crane_mp.testing.make_model import make_model
from tests.integration.server import Server, free_port
from tests.integration.test_server import kill_9_during_streams

NUM_TOKENS = 16
TP2 = ("--tensor-parallel-size", "2")
# float32 KV: tokens are compared with transformers' float32 (a 16-bit cache can flip a near tie)
EXACT = ("--kv-cache-dtype", "float32")

# Every architecture, and the shapes that split differently: fewer KV heads than ranks (each rank keeps
# the one its query heads read), biases on the row-parallel projections (only rank 0 adds them), and a
# vocabulary that does not divide (the last rank's rows padded).
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "hunyuan": ("hunyuan", {}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": False}),
    "llama-biases-odd-vocab": ("llama", {"attention_bias": True, "mlp_bias": True, "vocab_size": 500}),
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 490, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 70)]


def hf_greedy(model_dir, prompt_list: list[list[int]], **load) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, float32 (`load`: e.g. gguf_file=NAME)."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **load).eval()
    out = []
    for ids in prompt_list:
        with torch.inference_mode():
            tokens = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NUM_TOKENS,
                                 min_new_tokens=NUM_TOKENS, pad_token_id=0)
        out.append(tokens[0, len(ids):].tolist())
    return out


def gguf_greedy(path) -> tuple[list[list[int]], list[list[int]]]:
    """prompts() (ids below 490: within a tiny model's vocabulary), and transformers' greedy tokens
    reading the GGUF file."""
    return prompts(), hf_greedy(path.parent, prompts(), gguf_file=path.name)


async def _greedy(url: str, prompt_list: list[list[int]]) -> list[dict]:
    async def one(session, ids):
        body = {"prompt": ids, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS, "temperature": 0,
                "return_token_ids": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, ids) for ids in prompt_list))


def served(url: str, prompt_list: list[list[int]]) -> list[list[int]]:
    return [r["choices"][0]["token_ids"] for r in asyncio.run(_greedy(url, prompt_list))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(arch, "tiny", root / name, overrides=overrides, seed=9)
            for name, (arch, overrides) in MODELS.items()}


# qwen3's tokens over two ranks are checked under preemption below, llama's over two nodes.
@pytest.mark.parametrize("name", [name for name in MODELS if name not in ("qwen3", "llama")])
def test_two_ranks_serve_transformers_greedy_tokens(models, name, tmp_path):
    want = hf_greedy(models[name], prompts())
    srv = Server(models[name], *TP2, *EXACT, log_path=tmp_path / "log")
    try:
        assert served(srv.url, prompts()) == want
        info = requests.get(srv.url + "/server_info", timeout=10).json()
        assert info["tensor_parallel_size"] == 2 and info["nnodes"] == 1
        assert [r["rank"] for r in info["ranks"]] == [0, 1]
        assert "parallel: tp=2 nodes=1 ranks: 0 node0 Cpu" in srv.log_path.read_text()
    finally:
        assert srv.stop() == 0


def test_each_rank_holds_about_half_the_weights(tmp_path):
    model_dir = make_model("qwen3", "small", tmp_path / "small", seed=2)
    sizes = {}
    for tp in (1, 2):
        srv = Server(model_dir, "--tensor-parallel-size", str(tp), log_path=tmp_path / f"tp{tp}.log")
        try:
            info = requests.get(srv.url + "/server_info", timeout=10).json()
            sizes[tp] = [r["weights_bytes"] for r in info["ranks"]]
        finally:
            assert srv.stop() == 0
    [whole] = sizes[1]
    assert len(sizes[2]) == 2
    for part in sizes[2]:  # norms are whole on every rank; everything else splits
        assert 0.48 * whole < part < 0.55 * whole, (part, whole)


def test_preemption_and_the_prefix_cache_keep_two_ranks_exact(models, tmp_path):
    model_dir = models["qwen3"]
    gen = torch.Generator().manual_seed(5)
    competing = [torch.randint(3, 490, (n,), generator=gen).tolist() for n in (20, 25, 30, 18, 22, 28, 26, 31)]
    shared = prompts()[4]  # 70 tokens: four whole blocks to share
    want = hf_greedy(model_dir, competing + [shared, shared[:66] + [7, 8, 9]])
    # 8 KV blocks for 8 requests that each grow to 3-4: they preempt each other from the first steps.
    tight = Server(model_dir, *TP2, *EXACT, "--max-total-tokens", "128", "--max-concurrent", "8",
                   log_path=tmp_path / "log")
    try:
        results = asyncio.run(tight.all_queued(_greedy(tight.url, competing), len(competing)))
        assert [r["choices"][0]["token_ids"] for r in results] == want[:-2]
        assert tight.stats()["num_preemptions"] > 0
        first, second = (asyncio.run(_greedy(tight.url, [ids]))[0] for ids in (shared, shared[:66] + [7, 8, 9]))
        assert [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]] == want[-2:]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    finally:
        assert tight.stop() == 0


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    # Q4_K rows (256 columns a block) that split on block boundaries: o_proj's 512 and down's 512 inputs.
    hf_dir = make_model("qwen3", "tiny", tmp_path_factory.mktemp("hf") / "qwen3", seed=4,
                        overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 128})
    return make_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3-Q4_K_M.gguf", "Q4_K_M", name="tp")


def test_a_q4_k_m_file_splits_over_two_ranks(gguf_path, tmp_path):
    prompt_list, want = gguf_greedy(gguf_path)
    exact = Server(gguf_path, *TP2, *EXACT, "--quantized-activations", "float", log_path=tmp_path / "float.log")
    try:
        assert served(exact.url, prompt_list) == want
        info = requests.get(exact.url + "/server_info", timeout=10).json()
        assert info["model_format"] == "gguf" and len(info["ranks"]) == 2
        assert sum(r["weights_bytes"] for r in info["ranks"]) <= 1.15 * info["weights_file_bytes"]
    finally:
        assert exact.stop() == 0
    # The default 8-bit activations: each rank quantizes its own whole blocks, as one rank would.
    by_tp = {}
    for tp in (1, 2):
        srv = Server(gguf_path, "--tensor-parallel-size", str(tp), *EXACT, log_path=tmp_path / f"int8-{tp}.log")
        try:
            by_tp[tp] = served(srv.url, prompt_list)
        finally:
            assert srv.stop() == 0
    assert by_tp[2] == by_tp[1]


def test_a_file_whose_blocks_two_ranks_would_cut_serves_the_same_tokens(tmp_path):
    """o_proj's 256 input columns are one K-quant block: each rank keeps its half of them as float32."""
    hf_dir = make_model("llama", "tiny", tmp_path / "hf", seed=6,
                        overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    (tmp_path / "gguf").mkdir()  # no tokenizer files beside the file: its metadata has them
    path = make_gguf(hf_dir, tmp_path / "gguf" / "cut-Q4_K_M.gguf", "Q4_K_M", name="cut")
    prompt_list, want = gguf_greedy(path)
    srv = Server(path, *TP2, *EXACT, "--quantized-activations", "float", log_path=tmp_path / "log")
    try:
        assert served(srv.url, prompt_list) == want
        log = srv.log_path.read_text()
        assert "blk.0.attn_output.weight: a rank's share of its columns, [0, 128), cuts" in log
        assert "[128, 256), cuts" in log and "keeps it as float32" in log
    finally:
        assert srv.stop() == 0


def _worker_node(model_dir, port: int, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "crane_mp", "--model-path", str(model_dir), "--dtype", "float32", *TP2, *EXACT,
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}"]
    return subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait()


def test_two_nodes_on_one_host_serve_the_same_tokens_and_stop_together(models, tmp_path):
    model_dir = models["llama"]
    want = hf_greedy(model_dir, prompts())
    port = free_port()
    node1 = _worker_node(model_dir, port, tmp_path / "node1.log")
    try:
        node0 = Server(model_dir, *TP2, *EXACT, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                       f"127.0.0.1:{port}", log_path=tmp_path / "node0.log")
        try:
            assert served(node0.url, prompts()) == want
            info = requests.get(node0.url + "/server_info", timeout=10).json()
            assert info["nnodes"] == 2 and [r["node"] for r in info["ranks"]] == [0, 1]
            assert info["tp_size"] == 2 and info["dist_init_addr"] == f"127.0.0.1:{port}"
            assert "worker node 1 ready" in (tmp_path / "node1.log").read_text()
        finally:
            assert node0.stop() == 0
        # Node 0's drain reached node 1's rank as a last frame: it leaves cleanly too.
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        _kill_tree(node1)


def test_a_rank_killed_on_another_node_stops_the_server(models, tmp_path):
    model_dir = models["qwen2"]
    port = free_port()
    node1 = _worker_node(model_dir, port, tmp_path / "node1.log")
    try:
        node0 = Server(model_dir, *TP2, *EXACT, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                       f"127.0.0.1:{port}", log_path=tmp_path / "node0.log")
        try:
            rank1 = next(p for p in psutil.Process(node1.pid).children() if p.name() == "crane-worker")
            killed = time.monotonic()
            rank1.send_signal(signal.SIGKILL)
            assert node0.proc.wait(10) != 0  # noticed by the heartbeat: no request is in flight
            assert time.monotonic() - killed < 10
            assert node1.wait(10) != 0
        finally:
            node0.kill_all()
            node0.log.close()
    finally:
        _kill_tree(node1)


@pytest.mark.parametrize("victim", ["worker", "worker-1"])
def test_kill_9_of_a_rank_fails_every_stream_and_stops_the_server(models, tmp_path, victim):
    srv = Server(models["mistral"], *TP2, log_path=tmp_path / "log")
    try:
        tree = srv.process_tree()
        outcomes, elapsed = kill_9_during_streams(srv, victim)
        assert outcomes == ["error"] * 4 and elapsed < 10.0
        assert srv.proc.wait(10) != 0
        time.sleep(0.2)
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.kill_all()


def test_a_request_that_makes_the_ranks_raise_fails_alone(models, tmp_path):
    """Every rank raises on the same request and redoes the step request by request alike: the
    request fails, the batch it was in is served exactly, and so is what follows."""
    want = hf_greedy(models["hunyuan"], prompts())
    srv = Server(models["hunyuan"], *TP2, *EXACT, log_path=tmp_path / "log", env={"CRANE_MP_FAULT_TOKEN": "77"})
    try:
        async def poisoned():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": [11, 77, 12], "max_tokens": 8}
                async with session.post(srv.url + "/v1/completions", json=body) as resp:
                    return resp.status

        async def scenario():
            return await asyncio.gather(poisoned(), _greedy(srv.url, prompts()))

        status, results = asyncio.run(scenario())
        assert status == 500
        assert [r["choices"][0]["token_ids"] for r in results] == want
        assert served(srv.url, prompts()[:1]) == want[:1]
    finally:
        assert srv.stop() == 0
