"""Our models against transformers on the same float32 checkpoints: prefill logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from tests.model_helpers import prefill_span

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "hunyuan"]

# Shapes our generator's presets do not use: MHA, MQA, head_dim != hidden / heads, tied/untied, rope scaling.
VARIANTS = {
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen3-mqa-wide-heads": ("qwen3", {"num_key_value_heads": 1, "head_dim": 32, "tie_word_embeddings": False}),
    "qwen2-3layers-gqa4": ("qwen2", {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                                     "head_dim": 8, "intermediate_size": 96}),
    "hunyuan-untied": ("hunyuan", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
    "llama-all-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "hunyuan-ntk-alpha": ("hunyuan", {"rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}}),
    # Sliding windows from max_window_layers on: layer 0 full, layer 1 windowed (prompts cross 6 tokens).
    "qwen2-windowed-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
}

PROMPT_LENGTHS = [5, 17, 33, 9, 1, 24]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}
    for name, (arch, overrides) in VARIANTS.items():
        paths[name] = make_model(arch, "tiny", root / name, overrides=overrides, seed=7)
    return paths


def load_pair(path):
    """A float32 KV cache: logits are compared at float32 precision (the 16-bit default rounds keys and
    values; its kernels are checked in tests/unit)."""
    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="float32", force_cpu=True, max_num_seqs=32,
                                    kv_cache_dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return engine, hf


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one paged prefill over scratch blocks."""
    runner = engine.worker.runner
    span = prefill_span(runner, len(prompt))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.forward([], [span], prompt, list(range(len(prompt)))))


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ARCHS + list(VARIANTS))
def test_prefill_logits_and_greedy_tokens_match(checkpoints, name):
    engine, hf = load_pair(checkpoints[name])
    vocab = engine.worker.model_config.vocab_size
    prompts = random_prompts(vocab, PROMPT_LENGTHS)

    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[2]])).logits[0]
    ours = engine_prefill_logits(engine, prompts[2])
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)

    # min_tokens mirrors transformers' min_new_tokens: EOS is suppressed for all 32 tokens on both sides.
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ours = engine.generate(prompts, params)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, 32)
    assert engine.scheduler.num_free_blocks == engine.worker.kv_plan.num_blocks


def test_sharded_checkpoint_loads_identically(tmp_path, checkpoints):
    sharded = make_model("qwen3", "tiny", tmp_path / "sharded", shards=3)
    prompts = random_prompts(512, [11, 4])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    single = LLMEngine(EngineConfig(model_path=str(checkpoints["qwen3"]), dtype="float32", force_cpu=True))
    split = LLMEngine(EngineConfig(model_path=str(sharded), dtype="float32", force_cpu=True))
    assert single.generate(prompts, params) == split.generate(prompts, params)
