"""GGUF files of the 2026 families: a tiny checkpoint of each, converted to GGUF, gives transformers'
greedy tokens on the safetensors. Converted by make_gguf (llama.cpp's keys, names and norm offsets),
and, where ../shared/peers installed it, by llama.cpp's own convert_hf_to_gguf.py."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig, MemoryLimit
from crane_mp.engine import LLMEngine
from crane_mp.model_tokenizer import load_tokenizer
from crane_mp.models.config import load_gguf_config
from crane_mp.models.gguf_file import check_gguf, resolve_model_source
from crane_mp.models.layouts import FULL, SLIDING
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_gguf import make_gguf
from crane_mp.testing.make_zoo import make_zoo_model
from crane_mp.worker import bootstrap
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.quantized.layers import GGUFExperts
from crane_mp.worker.weights.offload import GPU_RESERVE_BYTES, HostExperts, expert_bytes_by_layer
from tests.llama_cpp import CONVERTER, CONVERTER_PYTHON, Converter

NUM_TOKENS = 10
# The families whose files we read, with the layer patterns llama.cpp's converter can state: Gemma 3's
# files carry no pattern (llama.cpp assumes every 6th layer global) and no query scale (head_dim's, as
# Gemma 3 below 27B has), SmolLM3's no-rope step is 4. llama.cpp's converter wants a sentencepiece
# tokenizer.model for Gemma 2: trained for the test with the converter's own sentencepiece.
NEEDS_SENTENCEPIECE = {"gemma2", "phi3"}
_TRAIN_SENTENCEPIECE = """
import random, sys, sentencepiece
words = ["alpha", "beta", "gamma", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "token"]
rng = random.Random(0)
with open(sys.argv[1] + "/corpus.txt", "w") as f:
    f.writelines(" ".join(rng.choice(words) for _ in range(12)) + "\\n" for _ in range(2000))
sentencepiece.SentencePieceTrainer.train(input=sys.argv[1] + "/corpus.txt", model_prefix=sys.argv[1] + "/tokenizer",
                                         vocab_size=256, model_type="bpe", hard_vocab_limit=False, minloglevel=2)
"""
GGUF_FAMILIES = {
    # Every 4th layer global, as llama.cpp assumes; its converter wants rotary_pct (transformers' config
    # has none: all of each head turns).
    "cohere2": {"layer_types": [SLIDING] * 3 + [FULL], "rotary_pct": 1.0},
    "gemma2": {"query_pre_attn_scalar": 16},  # every other layer sliding, as llama.cpp assumes
    "glm4": {},
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL], "query_pre_attn_scalar": 16},
    "olmo2": {},
    "phi3": {},  # LongRoPE, partial rotary, fused q/k/v and gate/up
    "olmo3": {},
    "exaone4": {},
    "granite": {},
    "seed_oss": {},
    "smollm3": {"no_rope_layers": [1, 1, 1, 0]},
}
# Mixtures of experts as llama.cpp converts them: every layer with experts (its converter maps no dense
# MLP beside them; GLM-4.5's leading dense layers it does), Mixtral without a window (a llama file states
# none), GLM-4.5 with one group of experts (as released).
MOE_OVERRIDES = {"qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {"decoder_sparse_step": 1},
                 "mixtral": {"sliding_window": None}, "glm4_moe": {"n_group": 1, "topk_group": 1}}
# Read from llama.cpp's own files only (make_gguf writes no per-layer metadata or experts): Gemma 4 with every
# option (per-layer inputs, shared KV, global layers of their own shape whose values are their keys);
# Granite 4 dense, which llama.cpp's converter writes as "granitehybrid" with every layer marked
# recurrent (KV heads 0) when transformers 5 spells its layers "full_attention", and as "granite" when
# the config says "attention" with no experts per token (as released checkpoints do).
CONVERTER_ONLY = {"gemma4_text": {}, "granitemoehybrid": {}, "granitemoehybrid-attention": {"num_experts_per_tok": 0},
                  **{family: MOE_OVERRIDES.get(family, {}) for family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
                                                                           "granitemoe", "gpt_oss", "glm4_moe",
                                                                           "deepseek_v2", "deepseek_v3")},
                  # Hybrids (Gated DeltaNet layers): Qwen3-Next with experts in every layer (its converter
                  # maps no dense MLP), each without its multi-token-prediction layer (ours hold a few of
                  # its tensors only).
                  "qwen3_5_text": {}, "qwen3_5": {}, "qwen3_5_moe_text": {}, "qwen3_next": {"mlp_only_layers": []}}
HYBRIDS = {"qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_next"}


def _rename_added_tokens(model_dir: Path, names: dict[str, str]) -> None:
    """Give added tokens other texts (their ids unchanged), in tokenizer.json and tokenizer_config.json."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for token in [*tokenizer["added_tokens"], *config["added_tokens_decoder"].values()]:
        token["content"] = names.get(token["content"], token["content"])
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _byte_fallback_bpe(model_dir: Path) -> None:
    """Gemma 4's converter reads the vocabulary as a byte-fallback BPE with a Sequence decoder (Gemma's
    own tokenizer.json): say so of the test's byte-level BPE (its ids unchanged)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["model"]["byte_fallback"] = True
    tokenizer["decoder"] = {"type": "Sequence", "decoders": [tokenizer["decoder"]]}
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def convert():
    converter = Converter()
    yield converter
    converter.close()


def gguf_engine(gguf: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(gguf), dtype="float32", force_cpu=True, kv_cache_dtype="float32"))


def greedy_pair(hf_dir: Path, gguf: Path, engine: LLMEngine | None = None) -> tuple[list[list[int]], list[list[int]]]:
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (23, 9, 40)]
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = engine or gguf_engine(gguf)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
    return got, expected


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_float32_gguf_file_gives_transformers_greedy_tokens(tmp_path, family):
    hf_dir = make_zoo_model(family, tmp_path / family, overrides=GGUF_FAMILIES[family])
    got, expected = greedy_pair(hf_dir, make_gguf(hf_dir, tmp_path / f"{family}.gguf", "F32"))
    assert got == expected


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES | CONVERTER_ONLY))
def test_llama_cpp_s_own_conversion_gives_transformers_greedy_tokens(tmp_path, family, convert):
    zoo_family, _, spelling = family.partition("-")
    hf_dir = make_zoo_model(zoo_family, tmp_path / family, overrides=(GGUF_FAMILIES | CONVERTER_ONLY)[family])
    if spelling == "attention":  # the released checkpoints' layer_types
        config = json.loads((hf_dir / "config.json").read_text())
        config["layer_types"] = ["attention"] * len(config["layer_types"])
        (hf_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / f"{family}.gguf"
    if family in NEEDS_SENTENCEPIECE:  # tokenizer.model beside tokenizer.json: the ids the test uses are the same
        subprocess.run([str(CONVERTER_PYTHON), "-c", _TRAIN_SENTENCEPIECE, str(hf_dir)], check=True,
                       capture_output=True)
    if family == "gemma4_text":
        _byte_fallback_bpe(hf_dir)
    if family in ("glm4", "glm4_moe"):  # its converter looks these up among the added tokens
        _rename_added_tokens(hf_dir, {"<|reserved_special_token_0|>": "<|endoftext|>",
                                      "<|reserved_special_token_1|>": "<|user|>",
                                      "<|reserved_special_token_2|>": "[gMASK]", "<|eom_id|>": "<|observation|>"})
    got, expected = greedy_pair(hf_dir, convert(hf_dir, "f32", out, *(["--no-mtp"] if family in HYBRIDS else [])))
    assert got == expected
    if family == "gemma4_text":  # the file names no <unk> (the test's vocabulary has none): text still encodes
        assert load_tokenizer(str(out)).encode("hello, 世界", add_special_tokens=False)


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
def test_llama_cpp_s_own_conversion_of_gemma4_to_q8_0_keeps_its_per_layer_table_quantized(tmp_path, convert):
    from crane_mp.worker.quantized.layers import GGUFEmbedding

    hf_dir = make_zoo_model("gemma4_text", tmp_path / "gemma4")
    _byte_fallback_bpe(hf_dir)
    out = tmp_path / "gemma4-q8_0.gguf"
    convert(hf_dir, "q8_0", out)
    engine = gguf_engine(out)
    assert isinstance(engine.worker.runner.model.model.embed_tokens_per_layer, GGUFEmbedding)
    got, expected = greedy_pair(hf_dir, out, engine)
    # 8-bit weights: the first tokens (the prompts' own argmax) agree; later ones may drift.
    assert [tokens[0] for tokens in got] == [tokens[0] for tokens in expected]


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_llama_cpp_s_own_conversion_of_experts_to_q8_0_keeps_them_quantized(tmp_path, family, convert):
    """A Q8_0 file's experts run through the GGUF kernels expert by expert: a layer's output equals the
    float experts' on the file's dequantized blocks, to the 8-bit activations' rounding (gpt-oss: with
    the file's biases and its clamped SwiGLU)."""
    import gguf

    from crane_mp.worker.models.moe import Experts

    hf_dir = make_zoo_model(family, tmp_path / family, overrides=MOE_OVERRIDES.get(family))
    out = tmp_path / f"{family}-q8_0.gguf"
    convert(hf_dir, "q8_0", out)
    engine = gguf_engine(out)
    quantized = engine.worker.runner.model.model.layers[1].mlp.experts
    assert isinstance(quantized, GGUFExperts)
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}

    def blocks(name: str) -> torch.Tensor:
        tensor = tensors[f"blk.1.{name}.weight"]
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()

    gate, up, down = blocks("ffn_gate_exps"), blocks("ffn_up_exps"), blocks("ffn_down_exps")
    count, width, hidden = gate.shape
    layout = engine.worker.model_config.layout.experts
    dense = Experts(count, hidden, width, quantized.act, layout=layout)
    dense.gate_up_proj.data, dense.down_proj.data = torch.cat([gate, up], 1), down
    if layout.bias:
        assert quantized.gate_up_bias.abs().sum() > 0 and quantized.down_bias.abs().sum() > 0
        dense.gate_up_bias.data, dense.down_bias.data = quantized.gate_up_bias, quantized.down_bias
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, hidden, generator=gen)
    ids = torch.stack([torch.randperm(count, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    with torch.inference_mode():
        expected = dense(x, ids, weights)
        tolerance = 0.03 * expected.abs().max().item()
        torch.testing.assert_close(quantized(x, ids, weights), expected, rtol=0, atol=tolerance)
    got, reference = greedy_pair(hf_dir, out, engine)
    assert len(got) == len(reference) and all(len(tokens) == NUM_TOKENS for tokens in got)


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
def test_llama_cpp_s_own_conversion_of_gpt_oss_mxfp4_experts_keeps_them_mxfp4(tmp_path, convert):
    """The released gpt-oss form (MXFP4 experts) through llama.cpp's converter: the file's experts stay
    MXFP4 blocks, and with float activations give transformers' tokens on the dequantized checkpoint."""
    from crane_mp.testing.make_zoo import make_mxfp4_experts

    reference = make_zoo_model("gpt_oss", tmp_path / "reference")
    released = make_mxfp4_experts(reference, tmp_path / "mxfp4")
    out = tmp_path / "gpt-oss-mxfp4.gguf"
    convert(released, "f32", out)
    engine = LLMEngine(EngineConfig(model_path=str(out), dtype="float32", force_cpu=True, kv_cache_dtype="float32",
                                    quantized_activations="float"))
    experts = engine.worker.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, GGUFExperts) and experts.down_type == 39  # MXFP4
    got, expected = greedy_pair(reference, out, engine)
    assert got == expected


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
def test_experts_kept_in_host_memory_give_the_tokens_of_the_ordinary_load(tmp_path, convert, monkeypatch):
    """Experts kept in host memory beside a GPU (weights/offload.py). On a stand-in GPU platform: a limit
    the file fits keeps every expert on the device, one it does not moves as few first layers' experts to
    the host as it needs, --cpu-moe-layers takes its count whatever fits. Forced on a CPU host: the first
    layer's experts built on the CPU platform's kernels and marked to run on the host (there the hop moves
    nothing) give the ordinary load's tokens, and only that layer is marked."""
    hf_dir = make_zoo_model("qwen3_moe", tmp_path / "qwen3_moe", overrides=MOE_OVERRIDES["qwen3_moe"])
    out = convert(hf_dir, "q8_0", tmp_path / "qwen3_moe-q8_0.gguf")
    source, model_config, contents = resolve_model_source(str(out)), load_gguf_config(out), check_gguf(out)
    first_layer = expert_bytes_by_layer(contents)[0]
    gpu = SimpleNamespace(on_cpu=False, default_memory_limit=MemoryLimit(fraction=0.9), total_memory=lambda: 2**40)
    config = EngineConfig(model_path=str(out), max_num_batched_tokens=16, max_num_seqs=16)
    room = GPU_RESERVE_BYTES + 16 * model_config.activation_bytes_per_token
    assert bootstrap._host_experts(config, model_config, source, gpu) is None
    config = replace(config, memory_limit=MemoryLimit(num_bytes=room + contents.tensor_bytes - first_layer // 2))
    assert bootstrap._host_experts(config, model_config, source, gpu).layers == {0}
    assert bootstrap._host_experts(replace(config, cpu_moe_layers=2), model_config, source, gpu).layers == {0, 1}

    want = greedy_pair(hf_dir, out)[0]
    cpu = platform_for("cpu")
    monkeypatch.setattr(bootstrap, "_host_experts", lambda config, *_: HostExperts(
        frozenset({0}), cpu, cpu.int8_matmuls(config.quantized_activations)))
    engine = gguf_engine(out)
    layers = engine.worker.runner.model.model.layers
    assert [layer.mlp.host_experts for layer in layers] == [True] + [False] * (len(layers) - 1)
    assert isinstance(layers[0].mlp.experts, GGUFExperts) and layers[0].mlp.experts.kernels is cpu.gguf
    assert greedy_pair(hf_dir, out, engine)[0] == want
