"""Tests for the tiny-model generator: HF loadability, tokenizer/templates, sharding, determinism, peaked logits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from crane_mp.testing.make_model import ARCHS, main, make_model
from crane_mp.testing.tokenizer import FAMILIES

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 你好 😀"},
    {"role": "assistant", "content": "Hello, café!"},
    {"role": "user", "content": "Again"},
]
# Text that must survive encode/decode and whose multi-byte characters the tiny vocab splits across tokens.
UNICODE_TEXT = "Crème brûlée in Zürich, 中文模型 and 👨‍👩‍👧 🚀!"


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Iterator[None]:
    # These models are too small to gain from a second thread, and on a shared 2-core box
    # oversubscribed intra-op threads run an order of magnitude slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_transformers_loads_checkpoint_unchanged(tiny_models: dict[str, Path], arch: str) -> None:
    model_dir = tiny_models[arch]
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == ARCHS[arch].model_type
    assert config.architectures == [ARCHS[arch].architecture]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (512, 64, 2)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["torch_dtype"] == raw["dtype"] == "float32"
    assert raw["rope_theta"] == config.rope_parameters["rope_theta"] == ARCHS[arch].rope_theta

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    for name, tensor in _tensors(model_dir).items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tokenizer_matches_config(tiny_models: dict[str, Path], arch: str) -> None:
    model_dir = tiny_models[arch]
    spec = FAMILIES[arch]
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert len(tok) == config.vocab_size
    assert tok.eos_token == spec.eos
    eos_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    assert tok.eos_token_id in eos_ids
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert tok.eos_token_id in generation["eos_token_id"]

    ids = tok(UNICODE_TEXT)["input_ids"]
    assert (ids[0] == tok.bos_token_id) == spec.add_bos
    assert tok.decode(ids, skip_special_tokens=True) == UNICODE_TEXT
    # Byte-level pieces of split characters do not decode to valid UTF-8 on their own.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for content, special in spec.added:
        token_id = tok.convert_tokens_to_ids(content)
        assert tok.encode(content, add_special_tokens=False) == [token_id]
        assert (tok.decode([token_id], skip_special_tokens=True) == "") == special


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_chat_template_renders(tiny_models: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert all(part in text for part in ("Be brief.", "Hi 你好 😀", "Hello, café!", "Again"))
    assert text.index("Be brief.") < text.index("Again")
    expected_tail = {
        "llama": "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "qwen2": "Again<|im_end|>\n<|im_start|>assistant\n",
        "qwen3": "Again<|im_end|>\n<|im_start|>assistant\n",
        "mistral": "Again[/INST]",
        "hunyuan": "<|startoftext|>Again<|extra_0|>",
    }[arch]
    assert text.endswith(expected_tail)
    if FAMILIES[arch].bos:
        assert text.startswith(FAMILIES[arch].bos)
    encoded = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    assert tok.decode(encoded["input_ids"]) == text  # no double BOS: the template carries it


def test_qwen3_template_thinking_switch(tiny_models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r</think>\n\na1"},
               {"role": "user", "content": "q2"}]
    thinking = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>r" not in thinking and "a1<|im_end|>" in thinking
    plain = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_sharded_checkpoint_has_complete_index(tmp_path: Path) -> None:
    model_dir = make_model("qwen2", "tiny", tmp_path, shards=3)
    shard_files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = _tensors(model_dir)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shard_files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for filename in shard_files:
        with safe_open(str(model_dir / filename), framework="pt") as f:
            assert all(index["weight_map"][name] == filename for name in f.keys())
    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # Re-running unsharded into the same directory must not leave the old shards behind.
    make_model("qwen2", "tiny", model_dir)
    assert sorted(p.name for p in model_dir.iterdir() if "safetensors" in p.name) == ["model.safetensors"]


@pytest.mark.parametrize(("arch", "overrides", "has_head"), [
    ("llama", None, True), ("qwen3", None, False), ("hunyuan", None, False),
    ("llama", {"tie_word_embeddings": True}, False), ("qwen3", {"tie_word_embeddings": False}, True),
])
def test_lm_head_present_only_when_untied(tmp_path: Path, arch: str, overrides: dict | None, has_head: bool) -> None:
    model_dir = make_model(arch, "tiny", tmp_path, overrides=overrides)
    assert ("lm_head.weight" in _tensors(model_dir)) == has_head
    assert AutoConfig.from_pretrained(model_dir).tie_word_embeddings == (not has_head)


def test_overrides_change_shapes_and_stay_loadable(tmp_path: Path) -> None:
    model_dir = make_model("qwen3", "tiny", tmp_path, overrides={"num_key_value_heads": 1, "head_dim": 32})
    tensors = _tensors(model_dir)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)


def test_cli_parses_json_and_string_values(tmp_path: Path) -> None:
    main(["--arch", "llama", "--size", "tiny", "--out", str(tmp_path), "--dtype", "bfloat16",
          "--set", "num_key_value_heads=4", "--set", "hidden_act=gelu",
          "--set", 'rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, '
                   '"high_freq_factor": 4.0, "original_max_position_embeddings": 1024}'])
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.num_key_value_heads, config.hidden_act) == (4, "gelu")
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    assert {t.dtype for t in _tensors(tmp_path).values()} == {torch.bfloat16}


def test_same_arguments_give_identical_files(tmp_path: Path) -> None:
    first = make_model("mistral", "tiny", tmp_path / "a", seed=7, shards=2)
    second = make_model("mistral", "tiny", tmp_path / "b", seed=7, shards=2)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
                 "config.json", "model.safetensors.index.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = _tensors(make_model("mistral", "tiny", tmp_path / "c", seed=8, shards=2))
    assert not torch.equal(other["model.embed_tokens.weight"], _tensors(first)["model.embed_tokens.weight"])


def _check_peaked(model_dir: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    gaps = []
    with torch.no_grad():
        for length in (16, 40, 64):
            logits = model(torch.randint(0, vocab, (2, length), generator=gen)).logits
            top2 = logits.topk(2, dim=-1).values
            gaps.append((top2[..., 0] - top2[..., 1]).flatten())
        gap = torch.cat(gaps)
        assert gap.median() > 0.5
        assert (gap > 1e-3).float().mean() > 0.98
        prompt = torch.randint(0, vocab, (1, 16), generator=gen)
        out = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert len(set(out[0, 16:].tolist())) >= 4


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_logits_are_peaked(tiny_models: dict[str, Path], arch: str) -> None:
    _check_peaked(tiny_models[arch])


def test_small_benchmark_model_logits_are_peaked(tmp_path: Path) -> None:
    model_dir = make_model("qwen3", "small", tmp_path)
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (512, 8, 8192)
    assert 25e6 < sum(t.numel() for t in _tensors(model_dir).values()) < 45e6
    _check_peaked(model_dir)
