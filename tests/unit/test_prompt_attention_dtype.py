"""Long prompts' attention in the platform's prompt dtype (bf16 on CPUs with AMX tiles or our AVX512-BF16
kernel, for float32 models whose cache holds bf16 keys): from _LOW_PRECISION_KEYS keys on, lone fresh
prompts and chunks over a cached context alike; shorter ones, or a platform that names no prompt dtype,
keep the queries' dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crane_mp.worker.cache import attention
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from crane_mp.worker.kernels import cpu_isa
from crane_mp.worker.platforms.cpu import CpuPlatform

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 32
CPU = torch.device("cpu")
SCALE = DIM**-0.5


@pytest.mark.parametrize(("isa", "kernel", "compute", "kv", "want"), [
    ("amx", False, torch.float32, torch.bfloat16, torch.bfloat16),
    ("amx", False, torch.bfloat16, torch.bfloat16, None),  # already bf16
    ("amx", False, torch.float32, torch.float32, None),  # a float32 cache keeps float32 keys
    ("avx512_bf16", True, torch.float32, torch.bfloat16, torch.bfloat16),  # our kernel takes them
    ("avx512_bf16", True, torch.float32, torch.float32, None),
    ("avx512_bf16", False, torch.float32, torch.bfloat16, None),  # torch's bf16 attention is no faster
])
def test_the_cpu_platform_names_bf16_with_tiles_or_our_kernel_and_a_bf16_cache(monkeypatch, isa, kernel, compute,
                                                                                kv, want):
    monkeypatch.setattr(cpu_isa, "cpu_isa", lambda: isa)
    monkeypatch.setattr(cpu_isa, "prompt_attention_kernel", lambda: kernel)
    platform = object.__new__(CpuPlatform)  # no kernels needed to answer
    assert platform.prompt_attention_dtype(compute, kv) == want


def _caches(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16),
            torch.zeros(blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16))


def _qkv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HEADS, DIM, generator=gen), torch.randn(tokens, KV_HEADS, DIM, generator=gen),
            torch.randn(tokens, KV_HEADS, DIM, generator=gen))


@pytest.mark.parametrize("tokens", [attention._LOW_PRECISION_KEYS - 1, attention._LOW_PRECISION_KEYS])
def test_a_fresh_prompt_attends_in_bf16_from_the_threshold(tokens):
    q, k, v = _qkv(tokens, 0)
    table = list(range(-(-tokens // BLOCK)))
    meta = build_metadata([], [SeqSpan(0, tokens, table)], BLOCK, CPU, torch.float32, "torch", torch.bfloat16)
    out = paged_attention(q, k, v, *_caches(len(table)), meta, SCALE)

    dtype = torch.bfloat16 if tokens >= attention._LOW_PRECISION_KEYS else torch.float32
    qs, ks, vs = (t.transpose(0, 1)[None].to(dtype) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE, enable_gqa=True).float()
    assert out.dtype == torch.float32
    assert torch.equal(out, want[0].transpose(0, 1).reshape(tokens, HEADS * DIM))


@pytest.mark.parametrize(("first", "second"), [(200, 100), (300, 300)])
def test_a_chunk_over_cached_keys_attends_in_bf16_from_the_threshold(first, second):
    """The second chunk of a prompt, its keys gathered from the cache: in bf16 from the threshold on
    (near the float32 result, not equal to it), in float32 below it (equal to the result of a platform
    that names no prompt dtype)."""
    q, k, v = _qkv(first + second, 1)
    table = list(range(-(-(first + second) // BLOCK)))
    outs = {}
    for prompt_dtype in (None, torch.bfloat16):
        caches = _caches(len(table))
        chunks = [SeqSpan(0, first, table), SeqSpan(first, second, table)]
        for span, rows in zip(chunks, (slice(0, first), slice(first, first + second))):
            meta = build_metadata([], [span], BLOCK, CPU, torch.float32, "torch", prompt_dtype)
            outs[prompt_dtype] = paged_attention(q[rows], k[rows], v[rows], *caches, meta, SCALE)
    assert outs[torch.bfloat16].dtype == torch.float32
    if first + second >= attention._LOW_PRECISION_KEYS:
        assert not torch.equal(outs[torch.bfloat16], outs[None])
        torch.testing.assert_close(outs[torch.bfloat16], outs[None], atol=3e-2, rtol=3e-2)
    else:
        assert torch.equal(outs[torch.bfloat16], outs[None])


def _kernel_available() -> bool:
    return cpu_isa.kernel_isa() is not None and bool(torch.ops.crane_mp.prompt_attention_available())


@pytest.mark.skipif(not _kernel_available(), reason="the native kernels of this tier lack AVX512-BF16")
@pytest.mark.parametrize(("first", "second"), [(0, 600), (100, 450), (520, 64), (100, 300)])
def test_prompts_go_through_our_kernel_where_the_metadata_names_it(first, second):
    """A fresh prompt (first 0) and a chunk over cached keys: the kernel's result over exactly the keys each
    query sees, the cache's padding past the last key ignored; below the threshold, torch's float32."""
    dim = 64
    gen = torch.Generator().manual_seed(first + second)
    q = torch.randn(first + second, HEADS, dim, generator=gen)
    k, v = (torch.randn(first + second, KV_HEADS, dim, generator=gen) for _ in range(2))
    table = list(range(-(-(first + second) // BLOCK) + 1))  # a spare block: padding the kernel must not read
    caches = tuple(torch.full((len(table), BLOCK, KV_HEADS, dim), 7.0, dtype=torch.bfloat16) for _ in range(2))
    chunks = [SeqSpan(0, first, table)] if first else []
    chunks.append(SeqSpan(first, second, table))
    for span in chunks:
        rows = slice(span.ctx_before, span.ctx_before + span.q_len)
        meta = build_metadata([], [span], BLOCK, CPU, torch.float32, "torch", torch.bfloat16, True)
        out = paged_attention(q[rows], k[rows], v[rows], *caches, meta, dim**-0.5)
    keys = first + second
    if keys >= attention._LOW_PRECISION_KEYS:
        want = torch.ops.crane_mp.prompt_attention_bf16(q[first:], k.bfloat16(), v.bfloat16(), dim**-0.5, first)
        assert torch.equal(out, want.reshape(second, HEADS * dim))
    else:
        meta = build_metadata([], [chunks[-1]], BLOCK, CPU, torch.float32, "torch", torch.bfloat16, False)
        assert torch.equal(out, paged_attention(q[first:], k[first:], v[first:], *caches, meta, dim**-0.5))
