"""gpt-oss's attention sinks (a logit per query head that joins the softmax with no value) on the
paged cache: the torch path against transformers' eager attention, the native decode kernel against it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from crane_mp.config import native_kernels_disabled
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from crane_mp.worker.kernels.cpu_isa import cpu_isa, kernel_isa

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 16, 4


def _reference(q, k, v, sinks, window):
    """transformers' gpt-oss attention of one sequence's queries (its last len(q) positions) over its keys."""
    num_q, num_k = q.shape[0], k.shape[0]
    positions = torch.arange(num_k - num_q, num_k)[:, None]
    keys = torch.arange(num_k)[None, :]
    allowed = (keys <= positions) & ((keys > positions - window) if window else True)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, HEAD_DIM**-0.5)
    return out[0].reshape(num_q, HEADS * HEAD_DIM)


def _sequence(gen, length):
    return [torch.randn(length, heads, HEAD_DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_step_of_decodes_and_chunked_prefills_attends_with_sinks_as_transformers_does(window, backend):
    if backend == "native" and (native_kernels_disabled() or cpu_isa() is None or kernel_isa() is None):
        pytest.skip("native kernels disabled, or a CPU below AVX2")
    gen = torch.Generator().manual_seed(7)
    sinks = 2.0 * torch.randn(HEADS, generator=gen)
    k_cache = torch.zeros(64, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    # Two decodes, then a chunk after cached tokens and a fresh prefill: (cached, new) tokens each.
    shapes = [(9, 1), (3, 1), (6, 7), (0, 11)]
    sequences = [_sequence(gen, cached + new) for cached, new in shapes]
    spans, start = [], 0
    for (cached, new), (_, k, v) in zip(shapes, sequences):
        blocks = list(range(start, start + -(-(cached + new) // BLOCK)))
        start += len(blocks)
        spans.append(SeqSpan(cached, new, blocks))
        for position in range(cached):  # the cached tokens' keys, as earlier steps wrote them
            slot = blocks[position // BLOCK] * BLOCK + position % BLOCK
            k_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = k[position]
            v_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = v[position]
    new_rows = [[t[cached:] for t in seq] for (cached, _), seq in zip(shapes, sequences)]
    q, k, v = (torch.cat([rows[i] for rows in new_rows]) for i in range(3))
    meta = build_metadata(spans[:2], spans[2:], BLOCK, CPU, torch.float32, backend)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window, None, sinks)
    expected = torch.cat([_reference(rows[0], seq[1], seq[2], sinks, window)
                          for rows, seq in zip(new_rows, sequences)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    without = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window)
    assert (out - without).abs().max() > 1e-2  # the sinks took their share
