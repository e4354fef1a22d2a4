"""Every natively served 2026 family on CUDA, from the tiny checkpoints of tests/correctness/test_model_zoo.py
(both layer kinds of each pattern, windows the prompts cross, soft-capped logits, experts, Gated DeltaNet
layers): float32 greedy tokens equal transformers' up to a float32 near tie through the Triton attention and
the decode graphs where the family has them, also under preemption, chunked prefill and the prefix cache;
bf16 equal to transformers' own bf16 run wherever that run is stable. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.models.registry import MODEL_TYPE_ALIASES
from crane_mp.testing.make_zoo import FAMILIES
from tests.gpu.test_cuda_paths import greedy_with_gaps
from tests.model_helpers import zoo_references

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NATIVE = sorted(f for f in FAMILIES if f in MODEL_TYPE_ALIASES)
NUM_TOKENS = 12
# Top-2 logit gap under which float32 runs summing in other orders may pick differently (Qwen3.5-MoE's
# tiny checkpoint has a step 4e-5 apart).
FLOAT32_TIE = 1e-3


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_references(tmp_path_factory.mktemp("zoo"), NUM_TOKENS)  # on CPU: the CPU engine's reference


def engine(path, dtype: str, **kwargs) -> LLMEngine:
    gc.collect()
    torch.cuda.empty_cache()
    kwargs.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model_path=str(path), dtype=dtype, **kwargs))


def assert_equal_up_to_float32_ties(eng: LLMEngine, prompts, expected) -> None:
    """Our greedy tokens equal transformers' float32 ones on CPU up to the first step whose top two logits
    lie within FLOAT32_TIE: there the device's other summation order may pick either."""
    tokens, gaps = greedy_with_gaps(eng, prompts, NUM_TOKENS)
    for mine, theirs, steps in zip(tokens, expected, gaps):
        stable = next((step for step, gap in enumerate(steps) if gap < FLOAT32_TIE), NUM_TOKENS)
        assert mine[:stable] == theirs[:stable]


@pytest.mark.parametrize("family", NATIVE)
def test_float32_on_cuda_gives_transformers_greedy_tokens_also_under_preemption(zoo, family):
    path, prompts, expected = zoo(family)
    eng = engine(path, "float32")
    runner = eng.worker.runner
    assert eng.worker.device.type == "cuda" and eng.worker.model_config.arch != "transformers"
    # The Triton kernels take no attention sinks (gpt-oss); steps that group rows by expert on the host,
    # read recurrent state slots or a media model's per-request state are not captured.
    sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in runner.model.modules())
    assert runner.attention_backend == ("torch" if sinks else "triton")
    config = eng.worker.model_config
    graphable = not sinks and config.layout.experts is None and not runner.state_layers and config.media is None
    assert (runner.decode_graphs is not None) == graphable
    assert_equal_up_to_float32_ties(eng, prompts, expected)
    tight = engine(path, "float32", max_num_seqs=6, max_total_tokens=96, max_num_batched_tokens=16,
                   enable_prefix_caching=True)
    assert_equal_up_to_float32_ties(tight, prompts, expected)
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.num_free_blocks == tight.worker.kv_plan.num_blocks


def tie_width(logits: torch.Tensor) -> float:
    """Gaps between the two best logits under which bf16 runs may pick differently: 1/32 of the best's
    magnitude (0.6 at logits of ~20; the tiny models' soft-capped logits stay within +-3)."""
    return max(logits.float().max().abs().item(), 1.0) / 32


@pytest.mark.parametrize("family", NATIVE)
def test_bf16_on_cuda_equals_transformers_bf16_where_its_run_is_stable(zoo, family):
    """Compared up to the first step where either run's top two logits are a near tie, or where
    transformers' bf16 tokens leave its own float32 ones: a bf16 rounding there flipped a choice no output
    gap shows (an expert chosen by the router, OLMoE's tiny checkpoint on its 4th prompt). Where
    transformers' own bf16 run is a near tie from every prompt's first step (Gemma 2 and 4 here: their
    logits capped at 3 round to the same bf16 values), nothing is comparable; elsewhere some steps must be."""
    path, prompts, float32_tokens = zoo(family)
    ours, our_gaps = greedy_with_gaps(engine(path, "bfloat16"), prompts, NUM_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    compared, transformers_opens_stable = 0, False
    for prompt, tokens, gaps, reference in zip(prompts, ours, our_gaps, float32_tokens):
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NUM_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        stable = next((step for step, (a, b) in enumerate(zip(want, reference)) if a != b), NUM_TOKENS)
        for step, (scores, gap) in enumerate(zip(out.scores[:stable], gaps)):
            top = scores[0].float().topk(2).values
            their_gap = (top[0] - top[1]).item()
            transformers_opens_stable |= step == 0 and their_gap >= tie_width(scores[0])
            if min(gap, their_gap) < tie_width(scores[0]):
                stable = step
                break
        assert tokens[:stable] == want[:stable]
        compared += stable
    assert compared > 0 or not transformers_opens_stable
