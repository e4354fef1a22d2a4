"""GGUF files served by our engine against transformers reading the same file (it dequantizes to
float): greedy tokens in float32 over a fixed prompt set, for every architecture and the types of
llama.cpp's common files; and the tokenizer built from GGUF metadata against the original one."""

from __future__ import annotations

import gc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.model_tokenizer import load_tokenizer
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_gguf import gguf_name, make_gguf, permute_rows
from crane_mp.testing.make_model import make_model

# Row lengths that are whole K-quant super-blocks (256), so no tensor falls back to another type.
SIZES = {
    "llama": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "mistral": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "qwen2": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "qwen3": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128},  # transformers' GGUF path assumes 128
    "hunyuan": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
}
TYPES = ["F16", "Q8_0", "Q4_K_M", "Q6_K"]
PROMPTS = [[5, 17, 33, 9, 1], [3], list(range(40, 71)), [100, 7, 7, 7, 250, 12, 60, 2]]
MAX_TOKENS = 10
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand    runs     of spaces",
    "héllo wörld — ünïcödé «quotes» 日本語のテキスト 中文 한국어 🤖🚀 emoji",
    "numbers 1234567890 3.14159 -42 1e-5",
    "code: def f(x):\n    return x ** 2  # square",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-models")
    return {arch: make_model(arch, "tiny", root / arch, overrides=SIZES[arch], seed=3) for arch in SIZES}


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-files")
    files = {}
    for arch, model_dir in checkpoints.items():
        for qtype in TYPES:
            (root / f"{arch}-{qtype}").mkdir()
            files[arch, qtype] = make_gguf(model_dir, root / f"{arch}-{qtype}" / f"{arch}-{qtype}.gguf", qtype,
                                           name="fixture")
    return files


def ours(path) -> list[list[int]]:
    """Float activations: the exact path (8-bit ones change tokens the way llama.cpp's do), and a
    float32 KV cache (the 16-bit default, bf16 on AVX512-BF16 CPUs, rounds keys and values: near ties
    of these random models then go either way)."""
    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="float32", max_model_len=128, seed=0,
                                    quantized_activations="float", kv_cache_dtype="float32"))
    return engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def reference_model(arch, path, model_dir):
    """transformers reading the GGUF file; Hunyuan, which its GGUF loader lacks, gets the same
    dequantized tensors put into the original checkpoint's model."""
    if arch != "hunyuan":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    state = model.state_dict()
    for name in state:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensor = tensors[gguf_name(name)]
        dims = [int(d) for d in reversed(tensor.shape.tolist())]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(dims)
        state[name] = torch.from_numpy(values)
    model.load_state_dict(state)
    return model


def greedy(model) -> list[list[int]]:
    """Plain argmax decoding (generate() would mask EOS ids until its min_new_tokens)."""
    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", list(SIZES))
def test_greedy_tokens_equal_transformers(arch, qtype, gguf_files, checkpoints):
    path = gguf_files[arch, qtype]
    with torch.inference_mode():
        want = greedy(reference_model(arch, path, checkpoints[arch]).eval())
    assert ours(path) == want


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_no_weight_stays_in_the_mapping_of_the_file(gguf_files, activations):
    """On CPU the loader maps the file: rows it repacks (int8) are converted from the mapping, the
    rest are copied out of it (Llama's q/k rows permuted on the way). Once loaded, nothing of the
    model is the mapping's: a weight left there would come back from disk after the kernel reclaimed
    its pages, in the middle of a request."""
    path = gguf_files["llama", "Q4_K_M"]
    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="float32", max_model_len=128, seed=0,
                                    quantized_activations=activations))
    gc.collect()
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert len(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0))[0]) == 2


def test_llama_rows_and_biases_are_unpermuted(tmp_path):
    """A Llama file holds llama.cpp's permuted q/k rows (and q/k biases); served, it must give the
    safetensors checkpoint's tokens (transformers' GGUF reader drops Llama biases, so it cannot judge)."""
    from safetensors.numpy import load_file

    model_dir = make_model("llama", "tiny", tmp_path / "llama-bias", seed=7,
                           overrides={**SIZES["llama"], "attention_bias": True, "mlp_bias": True})
    path = make_gguf(model_dir, tmp_path / "llama-bias-F32.gguf", "F32")
    stored = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(str(path)).tensors}
    original = load_file(str(model_dir / "model.safetensors"))
    for gguf_key, hf_key, heads in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
                                    ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias", 2)]:
        assert not np.allclose(stored[gguf_key], original[hf_key], atol=1e-3)
        np.testing.assert_array_equal(stored[gguf_key], permute_rows(original[hf_key], heads))
    direct = LLMEngine(EngineConfig(model_path=str(model_dir), dtype="float32", max_model_len=128,
                                    kv_cache_dtype="float32"))
    assert ours(path) == direct.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                 ignore_eos=True))


def test_llama3_rope_scaling_comes_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3's rope scaling as a rope_freqs tensor, not as metadata."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = make_model("llama", "tiny", tmp_path / "llama3", seed=8, overrides={**SIZES["llama"], "rope_parameters": rope})
    path = make_gguf(model_dir, tmp_path / "llama3-F32.gguf", "F32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    unscaled = make_model("llama", "tiny", tmp_path / "plain", seed=8, overrides=SIZES["llama"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    exact = {"dtype": "float32", "max_model_len": 128, "kv_cache_dtype": "float32"}
    direct = LLMEngine(EngineConfig(model_path=str(model_dir), **exact)).generate(PROMPTS, params)
    assert ours(path) == direct
    plain = LLMEngine(EngineConfig(model_path=str(unscaled), **exact)).generate(PROMPTS, params)
    assert plain != direct  # the scaling changes tokens, so the equality above says it was applied


@pytest.mark.parametrize("arch", list(SIZES))
def test_tokenizer_from_metadata_equals_the_original(arch, checkpoints, gguf_files):
    path = gguf_files[arch, "Q8_0"]
    original = AutoTokenizer.from_pretrained(str(checkpoints[arch]))
    from_gguf = load_tokenizer(str(path))
    assert from_gguf.chat_template == original.chat_template
    specials = [t for t in original.all_special_tokens if t]
    for text in CORPUS + [f"{specials[0]}hi{specials[-1]} there" if specials else "x"]:
        assert from_gguf.encode(text) == original.encode(text), text
        ids = original.encode(text, add_special_tokens=False)
        assert from_gguf.decode(ids) == original.decode(ids)
    assert from_gguf.eos_token == original.eos_token
