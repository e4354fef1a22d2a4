"""crane-launch on this year's families as a new user starts it: Gemma 3 and Gemma 4 checkpoints natively, an
Ernie 4.5 one (no native code) through the transformers backend. SGLang-style /generate callers get
transformers' greedy tokens; the start-up line and /server_info say which implementation runs, and what
a token's KV costs past the sliding windows."""

from __future__ import annotations

import pytest
import requests
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from crane_mp.testing.make_zoo import make_zoo_model
from crane_mp.testing.tokenizer import write_tokenizer
from tests.integration.server import Server

NUM_TOKENS = 10


def greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize(("family", "impl"), [("gemma3_text", "native"), ("gemma4_text", "native"),
                                             ("qwen3_moe", "native"), ("ernie4_5", "transformers")])
def test_generate_gives_transformers_greedy_tokens(tmp_path, family, impl):
    path = make_zoo_model(family, tmp_path / family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (19, 33)]
    server = Server(path, "--kv-cache-dtype", "float32", log_path=tmp_path / "server.log")
    try:
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}}
        answers = requests.post(server.url + "/generate", json=body, timeout=120).json()
        info = requests.get(server.url + "/server_info", timeout=10).json()
        metrics = requests.get(server.url + "/metrics", timeout=10).text
    finally:
        assert server.stop() == 0
    assert [a["output_ids"] for a in answers] == greedy(path, prompts)
    assert info["model_impl"] == impl
    ready = next(line for line in (tmp_path / "server.log").read_text().splitlines() if "ready in" in line)
    if impl == "transformers":
        assert "arch=ernie4_5(transformers backend: slower than native)" in ready
    elif family == "qwen3_moe":  # /metrics: the load balance over its 8 experts, 2 a token in 3 of 4 layers
        assert "arch=qwen3_moe " in ready
        routed = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("crane:expert_tokens_total{")]
        assert len(routed) == 8 and sum(routed) == sum(len(p) + NUM_TOKENS - 1 for p in prompts) * 2 * 3
    else:  # its sliding layers (6-token windows) in KV groups of their own, which keep only their windows
        assert f"arch={family.removesuffix('_text')} " in ready and "sliding windows" in ready
        assert sorted(set(info["kv_windows"])) == [0, 6]
        assert info["kv_bytes_per_token"] * 2 <= info["kv_bytes_per_token_in_window"]
        if family == "gemma4_text":  # past the window: its one caching global layer's (1 x 32 wide) K and V
            assert info["kv_bytes_per_token"] == 2 * 32 * 4


def test_gpt_oss_s_released_form_serves_the_dequantized_checkpoint_s_tokens(tmp_path):
    """gpt-oss as released (MXFP4 experts, attention sinks, sliding layers): its experts stay MXFP4, and
    with float activations /generate gives transformers' tokens on the dequantized checkpoint."""
    from crane_mp.testing.make_zoo import make_mxfp4_experts

    reference = make_zoo_model("gpt_oss", tmp_path / "reference")
    released = make_mxfp4_experts(reference, tmp_path / "released")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (21, 8)]
    server = Server(released, "--kv-cache-dtype", "float32", "--quantized-activations", "float",
                    log_path=tmp_path / "server.log")
    try:
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}}
        answers = requests.post(server.url + "/generate", json=body, timeout=120).json()
    finally:
        assert server.stop() == 0
    assert [a["output_ids"] for a in answers] == greedy(reference, prompts)
    ready = next(line for line in (tmp_path / "server.log").read_text().splitlines() if "ready in" in line)
    assert "arch=gpt_oss " in ready


def test_a_hybrid_recurrent_model_is_refused_at_start_by_name(tmp_path):
    """LFM2 interleaves short-convolution layers (no native code for them yet): refused with its name,
    not served as attention."""
    config = AutoConfig.for_model("lfm2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  layer_types=["conv", "full_attention", "conv", "full_attention"])
    config.architectures = ["Lfm2ForCausalLM"]
    config.save_pretrained(tmp_path)
    write_tokenizer("llama", 512, 512, tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, str(tmp_path / "model.safetensors"))
    server = Server(tmp_path, log_path=tmp_path / "server.log", wait=False)
    try:
        assert server.proc.wait(timeout=120) != 0
    finally:
        server.kill_all()
    assert "model_type 'lfm2' keeps recurrent state in its layers" in (tmp_path / "server.log").read_text()


def test_a_qwen3_5_checkpoint_serves_its_text_with_a_state_pool_and_refuses_images(tmp_path):
    """A Qwen3.5 checkpoint as released (vision tower, multi-token-prediction layer) but without its image
    processor's settings: its text through /generate gives transformers' tokens; /server_info and the
    start-up line give the state pool, whose bytes per sequence are its linear-attention layers'
    states; an image is refused by name (test_vision_language serves its images)."""
    path = make_zoo_model("qwen3_5", tmp_path / "qwen3_5")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (140, 6)]
    server = Server(path, "--kv-cache-dtype", "float32", "--max-concurrent", "4", "--max-num-batched-tokens", "32",
                    log_path=tmp_path / "server.log")
    try:
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}}
        answers = requests.post(server.url + "/generate", json=body, timeout=120).json()
        info = requests.get(server.url + "/server_info", timeout=10).json()
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        refused = requests.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "qwen3_5", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]})
    finally:
        assert server.stop() == 0
    assert [a["output_ids"] for a in answers] == greedy(path, prompts)
    config = AutoConfig.from_pretrained(str(path)).text_config
    linear = config.layer_types.count("linear_attention")
    conv = (2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim) * (config.linear_conv_kernel_dim - 1)
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    assert info["state_bytes_per_seq"] == linear * 4 * (conv + recurrent)  # float32 both
    assert info["state_slots"] == 4 and info["state_pool_bytes"] == 4 * info["state_bytes_per_seq"]
    ready = next(line for line in (tmp_path / "server.log").read_text().splitlines() if "ready in" in line)
    assert "arch=qwen3_5_vl " in ready and "state_pool=" in ready and "(4 sequences of" in ready
    assert "prefix_cache=off" in ready
    assert refused.status_code == 400 and "image" in refused.json()["error"]["message"]
