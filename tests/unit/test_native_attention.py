"""The native CPU decode-attention kernel against the portable torch path on the same paged cache."""

from __future__ import annotations

import pytest
import torch

from crane_mp.config import native_kernels_disabled
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from crane_mp.worker.kernels.cpu_isa import cpu_isa, kernel_isa

pytestmark = pytest.mark.skipif(
    native_kernels_disabled() or cpu_isa() is None, reason="native kernels disabled, or a CPU below AVX2"
)
CPU = torch.device("cpu")


def test_kernels_build_for_the_cpu_tier_in_use():
    assert kernel_isa() == cpu_isa(), "the native CPU kernels failed to build for this tier (see the log warning)"


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 16), (6, 1, 32), (4, 2, 40), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 7])
def test_native_decode_matches_torch_path(dtype, cache_dtype, heads, kv_heads, head_dim, window):
    """The kernel reads the cache in its own dtype (16-bit beside float32 queries: the CPU default)."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    block_size, num_blocks = 4, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    lengths = [1, 5, 16, 23]
    spans, start = [], 0
    for length in lengths:
        needed = -(-(length + 1) // block_size)
        spans.append(SeqSpan(length, 1, order[start : start + needed]))
        start += needed
    q = torch.randn(len(spans), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(spans), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(spans), kv_heads, head_dim, generator=gen).to(dtype)
    outs = []
    for native in (True, False):
        meta = build_metadata(spans, [], block_size, CPU, dtype, "native" if native else "torch")
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5, window))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
