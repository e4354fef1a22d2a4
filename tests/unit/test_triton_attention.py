"""The CUDA path's Triton paged-attention kernels, run on CPU through Triton's interpreter, against the
portable torch path on the same paged cache: mixed steps of decodes, fresh prefills and chunks after
cached context, GQA groups, padded head dims, sliding windows, soft-capped logits, images attended both
ways, split decode. Skipped without Triton."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHECK = """
import torch
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from crane_mp.worker.kernels.triton_attention import decode_workspace, paged_decode

CPU = torch.device("cpu")
cases = 0
for dtype, heads, kv_heads, head_dim, block_size, window, softcap in [
    (torch.float32, 8, 2, 64, 16, None, None), (torch.bfloat16, 8, 2, 128, 16, None, None),
    (torch.float32, 6, 1, 40, 4, None, None), (torch.float32, 4, 4, 64, 16, 21, None),
    (torch.bfloat16, 4, 2, 64, 4, 9, None), (torch.float32, 4, 2, 64, 16, 21, 2.0), (torch.bfloat16, 8, 2, 64, 16, None, 3.0),
]:
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    num_blocks = 96
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()

    def span(ctx_before, q_len):
        needed = -(-(ctx_before + q_len) // block_size)
        table = [free.pop() for _ in range(needed)]
        return SeqSpan(ctx_before, q_len, table)

    # decodes at 1, 17 and 150 keys (many blocks); a fresh 70-token prefill (two query tiles), a 5-token
    # chunk after 40 cached keys, and a 1-token chunk is a decode by definition.
    decodes = [span(0, 1), span(16, 1), span(149, 1)]
    prefills = [span(0, 70), span(40, 5)]
    total = len(decodes) + sum(s.q_len for s in prefills)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype) * (4 if softcap else 1)  # logits past the cap
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    outs = []
    for backend in ("triton", "torch"):
        meta = build_metadata(decodes, prefills, block_size, CPU, dtype, backend)
        assert meta.backend == backend
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim ** -0.5, window,
                                    softcap))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)

    # Images attended both ways (Gemma 3): spans across query tiles, and one in a chunk after cached keys.
    both_ways = []
    for backend in ("triton", "torch"):
        meta = build_metadata(decodes, prefills, block_size, CPU, dtype, backend)
        meta.bidirectional = [(0, 26, 40), (0, 60, 70), (1, 41, 44)]
        both_ways.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim ** -0.5, window,
                                         softcap))
    torch.testing.assert_close(both_ways[0].float(), both_ways[1].float(), atol=tol, rtol=tol)
    assert not torch.allclose(both_ways[1].float(), outs[1].float(), atol=tol, rtol=tol)

    # Every split count gives the same decode (the merge is exact up to rounding).
    meta = build_metadata(decodes, [], block_size, CPU, dtype, "triton")
    cache_k, cache_v = k_cache.clone(), v_cache.clone()
    paged_attention(q[:3], k[:3], v[:3], cache_k, cache_v, meta, head_dim ** -0.5, window, softcap)  # writes the new keys
    by_split = []
    for splits in (1, 3, 16):
        out = torch.empty(3, heads, head_dim, dtype=dtype)
        paged_decode(q[:3], cache_k, cache_v, meta.decode_block_tables, meta.decode_ctx_lens, out,
                     head_dim ** -0.5, window or 0, splits, decode_workspace(3, heads, head_dim, splits, CPU),
                     softcap=softcap or 0.0)
        by_split.append(out.float())
    for other in by_split[1:]:
        torch.testing.assert_close(other, by_split[0], atol=tol, rtol=tol)
    torch.testing.assert_close(by_split[0].view(3, -1), outs[1][:3].float(), atol=tol, rtol=tol)
    cases += 1
print("checked", cases)
"""


@pytest.mark.slow  # the Triton kernel interpreted with numpy: ~20 s; tests/gpu runs it compiled
def test_triton_paged_attention_equals_the_torch_path_in_the_interpreter():
    assert "checked 7" in run_interpreted(_CHECK)


_ENGINE_CHECK = """
import os, sys, torch
from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams

model_dir = sys.argv[1]
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 40, 75, 18, 9, 52)]
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = {}
for backend, fused in (("torch", False), ("triton", False), ("triton", True)):
    os.environ["CRANE_MP_ATTENTION"] = backend
    if fused:  # the layers call the Triton elementwise kernels, as they do on CUDA
        from crane_mp.worker.kernels import triton_elementwise
        from crane_mp.worker.platforms import platform_for
        platform_for("cpu").elementwise = triton_elementwise
    # float32 KV: a bf16 cache (the default on AVX512-BF16 CPUs) leaves near ties of this random model
    # that the backends' different summation orders break differently
    engine = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", force_cpu=True, max_num_seqs=6,
                                    max_num_batched_tokens=32, max_total_tokens=128, kv_cache_dtype="float32"))
    assert engine.worker.runner.attention_backend == backend
    outputs[backend, fused] = engine.generate(prompts, greedy)
    assert engine.scheduler.num_preemptions > 0
assert outputs["triton", False] == outputs["torch", False], outputs
assert outputs["triton", True] == outputs["torch", False], outputs
print("engine ok")
"""


@pytest.mark.slow  # a whole engine run through the interpreter, twice: over a minute
def test_engine_with_triton_attention_gives_the_torch_paths_greedy_tokens(tmp_path):
    """Chunked prefill (32-token budget), decodes beside chunks, and preemption under a 128-token cache;
    then also with the layers calling the Triton elementwise kernels (norms, SiLU*mul, rope + KV write)."""
    from crane_mp.testing.make_model import make_model

    model_dir = make_model("qwen3", "tiny", tmp_path / "qwen3", seed=4)
    assert "engine ok" in run_interpreted(_ENGINE_CHECK, str(model_dir))
