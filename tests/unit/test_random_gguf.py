"""The random-weight GGUF writer used for 8B-shape memory checks: its files load as llama.cpp's do,
keep their quantized types in memory, and run."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.random_gguf import random_blocks, random_gguf
from crane_mp.worker.quantized.formats import dequantize


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_random_blocks_decode_to_small_finite_weights(qtype):
    import torch

    data = random_blocks(40, 512, qtype, np.random.default_rng(0))
    weights = dequantize(torch.from_numpy(data), qtype, 512)
    assert bool(torch.isfinite(weights).all())
    assert 0.001 < weights.std().item() < 0.1 and weights.abs().max().item() < 0.5


def test_a_small_random_q4_k_m_file_loads_quantized_and_generates(tmp_path):
    path = random_gguf(tmp_path / "small.gguf", "small", "Q4_K_M")
    reader = gguf.GGUFReader(str(path))
    assert {T(t.tensor_type).name for t in reader.tensors} == {"F32", "Q4_K", "Q6_K"}
    engine = LLMEngine(EngineConfig(model_path=str(path), max_model_len=128, force_cpu=True))
    assert engine.worker.kv_plan.weights_bytes <= 1.05 * engine.worker.weights_file_bytes
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4 and all(0 <= t < engine.worker.model_config.vocab_size for t in out[0])


def test_every_token_of_a_random_file_prints(tmp_path, monkeypatch):
    """Random weights sample ids anywhere in the vocabulary, past the trained tokenizer's 8192 too (as in
    the 8B shape's 151,936): each must decode to text, or a streaming client sees nothing until the end
    (and measures no TTFT)."""
    from crane_mp.model_tokenizer import load_tokenizer
    from crane_mp.testing import random_gguf as module

    monkeypatch.setitem(module.SHAPES, "small", {"tie_word_embeddings": False, "vocab_size": 8192 + 512})
    path = random_gguf(tmp_path / "small.gguf", "small", "Q4_K_M")
    tokenizer = load_tokenizer(str(path))
    vocab = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokenizer) == len(vocab)
    assert len(vocab) == 8192 + 512
    for token_id in (100, 5000, 8192, len(vocab) - 1):
        assert tokenizer.decode([token_id], skip_special_tokens=True).strip(), token_id
    assert tokenizer.decode([len(vocab) - 1]) == f" w{len(vocab) - 1}"
    silent = [i for i in range(len(vocab)) if not tokenizer.decode([i], skip_special_tokens=True).strip("\ufffd ")]
    assert 100 < len(silent) < 1000  # special tokens and pieces of characters, all below 8192
    output = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output.weight")
    rows = gguf.quants.dequantize(output.data, output.tensor_type).reshape(len(vocab), -1)
    assert not rows[silent].any() and rows[8192:].any(axis=1).all()  # logit 0: never above random ones
    engine = LLMEngine(EngineConfig(model_path=str(path), max_model_len=128, force_cpu=True))
    prompts = [[5, 6, 7], [100, 2000, 30, 4], list(range(40, 90))]
    for tokens in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)):
        for token in tokens:  # greedy never lands on a token that prints nothing alone
            assert tokenizer.decode([token], skip_special_tokens=True).strip("\ufffd "), token


def test_a_random_mixture_of_experts_file_keeps_its_experts_quantized(tmp_path, monkeypatch):
    """The Qwen3-30B-A3B shape's writer at a small size: llama.cpp's stacked expert tensors in Q4_K and
    Q6_K, the router in float32 (as llama-quantize leaves it), served through the quantized experts."""
    from crane_mp.testing import random_gguf as module
    from crane_mp.worker.quantized.layers import GGUFExperts

    model_type, shape = module.FAMILY_SHAPES["qwen3-30b-a3b"]
    small = {**shape, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "vocab_size": 8192, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256}
    monkeypatch.setitem(module.FAMILY_SHAPES, "qwen3-30b-a3b", (model_type, small))
    path = random_gguf(tmp_path / "moe.gguf", "qwen3-30b-a3b", "Q4_K_M", layers=2)
    types = {t.name: T(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"
    engine = LLMEngine(EngineConfig(model_path=str(path), max_model_len=128, force_cpu=True))
    assert engine.worker.model_config.arch == "qwen3_moe"
    assert isinstance(engine.worker.runner.model.model.layers[1].mlp.experts, GGUFExperts)
    assert engine.worker.kv_plan.weights_bytes <= 1.05 * engine.worker.weights_file_bytes
    out = engine.generate([[5, 6, 7], list(range(40, 70))], SamplingParams(temperature=0.0, max_tokens=4,
                                                                            ignore_eos=True))
    assert [len(tokens) for tokens in out] == [4, 4]


def test_a_random_qwen3_5_file_holds_both_layer_kinds_as_llama_cpp_names_them(tmp_path, monkeypatch):
    """The Qwen3.5 shape's writer at a small size: Gated DeltaNet layers (ssm_a negative, the
    convolution in float32) and attention layers as llama.cpp's files hold them, served quantized."""
    from crane_mp.testing import random_gguf as module
    from crane_mp.worker.models.gated_deltanet import GatedDeltaNet
    from crane_mp.worker.quantized.layers import GGUFLinear

    model_type, shape = module.FAMILY_SHAPES["qwen3.5"]
    small = {**shape, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
    monkeypatch.setitem(module.FAMILY_SHAPES, "qwen3.5", (model_type, small))
    path = random_gguf(tmp_path / "qwen3.5.gguf", "qwen3.5", "Q4_K_M", layers=4)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: T(t.tensor_type).name for t in reader.tensors}
    assert types["blk.0.attn_qkv.weight"] in ("Q4_K", "Q6_K") and types["blk.3.attn_q.weight"] in ("Q4_K", "Q6_K")
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and "blk.0.ssm_dt.bias" in types and "blk.3.ssm_a" not in types
    assert int(reader.fields["qwen35.full_attention_interval"].parts[-1][0]) == 4
    engine = LLMEngine(EngineConfig(model_path=str(path), max_model_len=128, force_cpu=True))
    layers = engine.worker.runner.model.model.layers
    assert engine.worker.model_config.arch == "qwen3_5"
    assert isinstance(layers[0].self_attn, GatedDeltaNet) and isinstance(layers[0].self_attn.in_proj, GGUFLinear)
    assert not isinstance(layers[3].self_attn, GatedDeltaNet)
    out = engine.generate([[5, 6, 7], list(range(40, 140))], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True))
    assert [len(tokens) for tokens in out] == [4, 4]


@pytest.mark.parametrize("drop", [True, False])
def test_a_loaded_files_pages_leave_the_page_cache_unless_kept(tmp_path, drop):
    """What the worker copied into its own layout is dropped from the page cache (--keep-page-cache
    keeps it): the host holds the weights once."""
    import torch

    from crane_mp.models.config import load_gguf_config
    from crane_mp.worker.platforms import select_platform
    from crane_mp.worker.quantized.gguf_loader import load_gguf_model
    from tests.unit.test_file_reader import cached_file, resident_pages

    path = random_gguf(tmp_path / "small.gguf", "small", "Q4_K_M")
    cached_file(path)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    platform = select_platform(force_cpu=True)
    load_gguf_model(load_gguf_config(path, "auto"), path, torch.float32, platform, progress=False,
                    int8=platform.int8_matmuls("auto"), drop_file_pages=drop)
    start = min(int(t.data_offset) for t in tensors.values())
    tensor_pages = resident_pages(path)[-(-start // mmap.PAGESIZE) : -1]  # the file's last page aside
    # Dropped: all but the large pages a tensor shares with its neighbours (norms of a few KB here).
    assert tensor_pages.mean() < 0.2 if drop else tensor_pages.all()
