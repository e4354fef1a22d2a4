"""Qwen3.5 and Qwen3-Next (Gated DeltaNet layers beside gated attention) against transformers: prompts
of 5 to 300 tokens in mixed batches, chunked into small steps and preempted, give transformers' greedy
tokens; a request that raises fails alone while the others recompute their state; the state pool holds
one slot per running sequence and bounds how many run."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_zoo import make_zoo_model
from tests.model_helpers import transformers_greedy

HYBRIDS = ["qwen3_5", "qwen3_5_moe_text", "qwen3_next"]
NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
LENGTHS = [300, 5, 131, 1, 64, 17]  # a block of the chunked rule is 64 tokens


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            path = make_zoo_model(family, tmp_path_factory.mktemp(family))
            gen = torch.Generator().manual_seed(7)
            prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in LENGTHS]
            made[family] = path, prompts, transformers_greedy(path, prompts, NUM_TOKENS)
        return made[family]

    return get


def engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(path), dtype="float32", force_cpu=True, kv_cache_dtype="float32",
                                  **kwargs))


@pytest.mark.parametrize("family", HYBRIDS)
def test_long_prompts_chunked_and_preempted_in_mixed_batches_give_transformers_tokens(hybrid, family):
    path, prompts, expected = hybrid(family)
    eng = engine(path, max_num_seqs=4, max_num_batched_tokens=24, max_total_tokens=400)
    assert eng.generate(prompts, GREEDY) == expected
    assert eng.scheduler.num_preemptions > 0
    runner = eng.worker.runner
    assert runner.state_pool.num_free == runner.state_pool.slots and not runner.requests


def test_the_state_pool_holds_each_running_sequence_and_the_prefix_cache_is_off(hybrid):
    path, prompts, expected = hybrid("qwen3_5")
    eng = engine(path, max_num_seqs=3, enable_prefix_caching=True)
    plan, runner = eng.worker.kv_plan, eng.worker.runner
    layers = runner.model.state_layers()
    assert len(layers) == 2 and len(runner.model.attention_layers()) == 2  # both kinds, twice
    assert plan.state_slots == runner.state_pool.slots == 3 == eng.scheduler.config.max_num_seqs
    assert plan.state_bytes_per_seq == sum(layer.conv_state[0].nbytes + layer.recurrent_state[0].nbytes
                                           for layer in layers)
    assert layers[0].recurrent_state.dtype == torch.float32
    assert not eng.scheduler.config.enable_prefix_caching
    shared = [prompts[0][:200] + p for p in prompts[1:3]]  # a 200-token prefix the second request shares
    assert eng.generate(shared, GREEDY) == transformers_greedy(path, shared, NUM_TOKENS)


def test_a_request_that_raises_fails_alone_and_the_batch_recomputes_its_state(hybrid, monkeypatch):
    path, prompts, expected = hybrid("qwen3_next")
    good = [(p, e) for p, e in zip(prompts, expected) if 7 not in p]
    monkeypatch.setenv("CRANE_MP_FAULT_TOKEN", "7")  # the runner's test hook: this prompt token raises
    eng = engine(path, max_num_seqs=8, max_num_batched_tokens=32)
    rids = [eng.add_request(p, GREEDY) for p, _ in good]
    bad = eng.add_request([11, 7, 12, 13], GREEDY)
    tokens: dict[int, list[int]] = {}
    finished = {}
    while eng.has_work:
        for out in eng.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.rid] = out
    assert [tokens[rid] for rid in rids] == [e for _, e in good]
    assert finished[bad].error.startswith("internal error in the model worker") and not tokens.get(bad)
    runner = eng.worker.runner
    assert runner.state_pool.num_free == runner.state_pool.slots


def test_the_recurrent_state_s_dtype_is_a_flag_and_the_pool_follows(hybrid):
    path, prompts, expected = hybrid("qwen3_5_moe_text")
    full, half = engine(path, max_num_seqs=2), engine(path, max_num_seqs=2, mamba_ssm_cache_dtype="bfloat16")
    layer = half.worker.runner.state_layers[0]
    assert layer.recurrent_state.dtype == torch.bfloat16 and layer.conv_state.dtype == torch.float32
    recurrent = sum(layer.recurrent_state[0].numel() for layer in half.worker.runner.state_layers)
    assert full.worker.kv_plan.state_bytes_per_seq - half.worker.kv_plan.state_bytes_per_seq == 2 * recurrent
    assert len(half.generate(prompts[:2], GREEDY)[0]) == NUM_TOKENS
