"""The engine's output must not depend on batching, chunking or preemption; KV blocks always come back."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3"))


def engine(model_dir: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_num_seqs", 32)
    return LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", force_cpu=True, **kwargs))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=gen).tolist()
    return [torch.randint(3, 512, (length,), generator=gen).tolist() for length in lengths]


def test_batch_of_32_equals_each_alone(model_dir):
    eng = engine(model_dir)
    batch = prompts(32)
    together = eng.generate(batch, GREEDY)
    alone = [eng.generate([p], GREEDY)[0] for p in batch[:8]]
    assert together[:8] == alone
    assert all(len(t) == 24 for t in together)
    assert eng.scheduler.num_free_blocks == eng.worker.kv_plan.num_blocks


def test_chunked_prefill_equals_unchunked(model_dir):
    batch = prompts(6, seed=1)
    whole = engine(model_dir, max_num_batched_tokens=2048).generate(batch, GREEDY)
    chunked_engine = engine(model_dir, max_num_seqs=4, max_num_batched_tokens=7)
    assert chunked_engine.generate(batch, GREEDY) == whole


def test_preemption_is_lossless(model_dir):
    batch = prompts(12, seed=2)
    reference = engine(model_dir).generate(batch, GREEDY)
    tight = engine(model_dir, max_num_seqs=12, max_total_tokens=128)
    assert tight.generate(batch, GREEDY) == reference
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.num_free_blocks == tight.worker.kv_plan.num_blocks


def test_penalties_survive_preemption_and_their_table_stays_at_its_profiled_size(model_dir):
    """A preempted request keeps its penalty row; preempted requests resume before new ones are admitted,
    so the table never holds more than max_num_seqs rows, the size the memory plan profiled."""
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.4, presence_penalty=0.3)
    batch = prompts(20, seed=7)
    reference = engine(model_dir).generate(batch, penalised)
    tight = engine(model_dir, max_num_seqs=8, max_total_tokens=128)
    profiled_rows = tight.worker.runner.sampler.penalties.counts.shape[0]
    assert tight.generate(batch, penalised) == reference
    assert tight.scheduler.num_preemptions > 0
    assert tight.worker.runner.sampler.penalties.counts.shape[0] == profiled_rows


def test_seeded_sampling_is_batch_independent(model_dir):
    eng = engine(model_dir)
    batch = prompts(10, seed=3)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(batch))]
    together = eng.generate(batch, seeded)
    alone = [eng.generate([p], [s])[0] for p, s in zip(batch[:4], seeded[:4])]
    assert together[:4] == alone
    unseeded = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)
    assert len({tuple(eng.generate([batch[0]], unseeded)[0]) for _ in range(3)}) > 1  # unseeded really varies


def test_aborted_and_finished_requests_return_every_block(model_dir):
    eng = engine(model_dir, max_num_seqs=8)
    total = eng.worker.kv_plan.num_blocks
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts(8, seed=4)]
    for _ in range(3):
        eng.step()
    assert eng.scheduler.num_free_blocks < total
    for req_id in ids[::2]:
        eng.abort_request(req_id)
    while eng.has_work:
        eng.step()
        eng.scheduler.check_invariants()
    assert eng.scheduler.num_free_blocks == total
    assert eng.worker.runner.requests == {}  # the worker dropped every mirror too


def test_logprobs_come_back_for_the_sampled_token(model_dir):
    eng = engine(model_dir)
    req = eng.add_request(prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
    seen = []
    while eng.has_work:
        for out in eng.step():
            assert out.rid == req
            seen += out.logprobs
    assert len(seen) == 4
    for lp in seen:
        assert lp.logprob <= 0 and lp.top_logprobs[0] >= lp.logprob - 1e-6 and len(lp.top_token_ids) == 3


def test_overlap_and_prefix_cache_never_change_greedy_tokens_even_under_preemption(model_dir):
    shared = [3 + (i * 37) % 500 for i in range(100)]  # a long common prefix, as a chat's system prompt
    batch = [shared + p for p in prompts(10, seed=9)] + prompts(4, seed=10)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True) for i in range(len(batch))]
    params[-1] = SamplingParams(temperature=0.8, seed=5, max_tokens=17, ignore_eos=True)
    reference = engine(model_dir, enable_prefix_caching=False, overlap_schedule=False).generate(batch, params)
    for cache in (False, True):
        for overlap in (False, True):
            roomy = engine(model_dir, enable_prefix_caching=cache, overlap_schedule=overlap)
            assert roomy.generate(batch[:1], params[:1]) == reference[:1]  # warms the cache with the prefix
            assert roomy.generate(batch, params) == reference, (cache, overlap)
            tight = engine(model_dir, max_total_tokens=256, enable_prefix_caching=cache, overlap_schedule=overlap)
            assert tight.generate(batch, params) == reference, (cache, overlap, "preempted")
            assert tight.scheduler.num_preemptions > 0
            assert tight.scheduler.num_free_blocks == tight.worker.kv_plan.num_blocks
    assert roomy.scheduler.prefix_cache_hits >= 10 * (len(shared) // 16 * 16)  # the shared prefix really hit


def test_prompt_logprobs_match_a_full_forward_and_survive_chunking(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    prompt = prompts(1, seed=7)[0] + prompts(1, seed=8)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    # The whole prompt in one step, in 5-token chunks, and in one step scored 3 rows per pass.
    for budget, score_rows in ((2048, None), (5, None), (2048, 3)):
        # Compared at float32 precision: a float32 KV cache (the 16-bit default rounds keys and values).
        eng = engine(model_dir, max_num_seqs=4, max_num_batched_tokens=budget, kv_cache_dtype="float32")
        if score_rows:
            monkeypatch.setattr(eng.worker.runner, "_score_rows", lambda: score_rows)
        req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
        scored = []
        while eng.has_work:
            for out in eng.step():
                assert out.rid == req
                scored += out.prompt_logprobs
        assert [s.start for s in scored] == sorted(s.start for s in scored) and scored[0].start == 1
        values = [v for s in scored for v in s.logprobs]
        torch.testing.assert_close(torch.tensor(values), expected, atol=1e-4, rtol=1e-4)
        tops = [t for s in scored for t in s.top_token_ids]
        assert len(tops) == len(prompt) - 1 and all(len(t) == 2 for t in tops)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_raises_in_the_worker_fails_alone(model_dir, monkeypatch, overlap):
    batch = [p for p in prompts(6, seed=4) if 7 not in p]
    scored = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    expected = engine(model_dir).generate(batch, GREEDY)
    monkeypatch.setenv("CRANE_MP_FAULT_TOKEN", "7")  # the runner's test hook: this prompt token raises
    eng = engine(model_dir, overlap_schedule=overlap)
    good = [eng.add_request(p, GREEDY) for p in batch]
    bad = eng.add_request([11, 7, 12, 13], GREEDY)
    with_logprobs = eng.add_request(batch[0], scored)
    tokens: dict[int, list[int]] = {}
    finished = {}
    prompt_scores = []
    while eng.has_work:
        for out in eng.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            prompt_scores += [p for p in out.prompt_logprobs if p.req_id == with_logprobs]
            if out.finish_reason is not None:
                finished[out.rid] = out
    assert [tokens[rid] for rid in good] == expected and tokens[with_logprobs] == expected[0]
    assert finished[bad].error.startswith("internal error in the model worker (RuntimeError)")
    assert "fault injected" not in finished[bad].error  # the exception's text stays in the log
    assert not tokens.get(bad) and all(finished[rid].error is None for rid in good)
    # The step was run again request by request: prompt logprobs of the batch came through once each.
    assert sum(len(p.logprobs) for p in prompt_scores) == len(batch[0]) - 1
    assert eng.scheduler.num_free_blocks == eng.worker.kv_plan.num_blocks
    assert not eng.worker.runner.failed and not eng.worker.runner.requests


@pytest.mark.parametrize("message", ["CUDA error: an illegal memory access was encountered",
                                     "Triton Error [CUDA]: an illegal memory access was encountered",
                                     "Triton Error [CUDA]: misaligned address"])
def test_a_device_fault_is_no_one_requests_fault_and_stops_the_engine(model_dir, monkeypatch, message):
    eng = engine(model_dir, overlap_schedule=False)
    runner = eng.worker.runner

    def device_fault(req_ids):
        raise RuntimeError(message)

    monkeypatch.setattr(runner, "fault_token", 7)
    monkeypatch.setattr(runner, "_inject_fault", device_fault)
    eng.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="CUDA"):  # not retried request by request on a dead context
        eng.step()
    assert not runner.failed
