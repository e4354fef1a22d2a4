"""The CUDA path's Triton paged-attention kernels, run on CPU through Triton's interpreter, against the
portable torch path on the same paged cache: mixed steps of decodes, fresh prefills and chunks after
cached context, GQA groups, padded head dims, sliding windows, soft-capped logits, images attended both
ways, split decode. Skipped without Triton."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted_together

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


_ENGINE_CHECK = """
import os, torch
from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams

gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 40, 75, 18, 9, 52)]
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = {}
for backend in ("torch", "triton"):
    os.environ["CRANE_MP_ATTENTION"] = backend
    if backend == "triton" and fused:  # the layers call the Triton elementwise kernels, as they do on CUDA
        from crane_mp.worker.kernels import triton_elementwise
        from crane_mp.worker.platforms import platform_for
        platform_for("cpu").elementwise = triton_elementwise
    # float32 KV: a bf16 cache (the default on AVX512-BF16 CPUs) leaves near ties of this random model
    # that the backends' different summation orders break differently
    engine = LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", force_cpu=True, max_num_seqs=6,
                                    max_num_batched_tokens=32, max_total_tokens=128, kv_cache_dtype="float32"))
    assert engine.worker.runner.attention_backend == backend
    outputs[backend] = engine.generate(prompts, greedy)
    assert engine.scheduler.num_preemptions > 0
assert outputs["triton"] == outputs["torch"], outputs
print("engine ok")
"""


# The kernels interpreted with numpy (tests/gpu runs them compiled): the cases above, and two engine runs,
# each in a process of its own at once (one core each; ~50 s of work).
@pytest.mark.slow
def test_triton_attention_equals_the_torch_path_in_the_interpreter_also_inside_the_engine(tmp_path):
    """The engine runs chunked prefill (32-token budget), decodes beside chunks, and preemption under a
    128-token cache; once with the Triton attention alone, once with the layers also calling the Triton
    elementwise kernels (norms, SiLU*mul, rope + KV write)."""
    from crane_mp.testing.make_model import make_model

    model_dir = make_model("qwen3", "tiny", tmp_path / "qwen3", seed=4)
    engines = [f"model_dir = {str(model_dir)!r}\nfused = {fused}\n" + _ENGINE_CHECK for fused in (False, True)]
    kernels, *runs = run_interpreted_together(_CHECK, *engines)
    assert "checked 7" in kernels
    assert all("engine ok" in run for run in runs)
