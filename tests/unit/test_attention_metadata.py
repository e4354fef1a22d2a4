"""A step's attention inputs (KV slots, padded block tables, context lengths, chunk offsets) as
build_metadata packs them into one buffer, against a per-token reference, for mixed steps whose
decodes and prefill chunks start anywhere within a block."""

from __future__ import annotations

import random

import pytest
import torch

from crane_mp.worker.cache.attention import SeqSpan, build_metadata

BLOCK = 4


def _span(rng: random.Random, free: list[int], ctx_before: int, q_len: int) -> SeqSpan:
    blocks = -(-(ctx_before + q_len) // BLOCK)
    table = [free.pop() for _ in range(blocks)]
    return SeqSpan(ctx_before, q_len, table)


def _padded(spans: list[SeqSpan], lengths: list[int]) -> list[list[int]]:
    width = max(-(-n // BLOCK) for n in lengths)
    return [s.block_table[: -(-n // BLOCK)] + [0] * (width - -(-n // BLOCK)) for s, n in zip(spans, lengths)]


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_metadata_equals_a_per_token_reference(backend, seed):
    rng = random.Random(seed)
    free = rng.sample(range(1000), 1000)
    decodes = [_span(rng, free, rng.randrange(0, 40), 1) for _ in range(rng.randrange(0, 5))]
    prefills = [_span(rng, free, rng.choice([0, rng.randrange(1, 30)]), rng.randrange(1, 20))
                for _ in range(rng.randrange(0 if decodes else 1, 4))]
    meta = build_metadata(decodes, prefills, BLOCK, torch.device("cpu"), torch.float32, backend)

    want_slots = [s.block_table[p // BLOCK] * BLOCK + p % BLOCK
                  for s in decodes + prefills for p in range(s.ctx_before, s.ctx_before + s.q_len)]
    assert meta.slot_mapping.tolist() == want_slots
    assert meta.num_decode_tokens == len(decodes) and meta.num_prefills == len(prefills)
    if decodes:
        lengths = [s.ctx_before + 1 for s in decodes]
        assert meta.decode_block_tables.tolist() == _padded(decodes, lengths)
        assert meta.decode_ctx_lens.tolist() == lengths
    if meta.prefill_block_tables is not None:
        assert meta.prefill_block_tables.tolist() == _padded(prefills, [s.ctx_before + s.q_len for s in prefills])
    if backend == "triton" and prefills:
        starts = [len(decodes) + sum(s.q_len for s in prefills[:p]) for p in range(len(prefills))]
        assert meta.prefill_q_start.tolist() == starts
        assert meta.prefill_q_len.tolist() == [s.q_len for s in prefills]
        assert meta.prefill_ctx_before.tolist() == [s.ctx_before for s in prefills]
    elif meta.prefill_token_index is not None:
        max_q = max(s.q_len for s in prefills)
        assert meta.prefill_valid_index.numel() == sum(s.q_len for s in prefills)
        assert meta.prefill_token_index.numel() == len(prefills) * max_q


def test_a_table_too_short_for_its_tokens_is_refused():
    with pytest.raises(IndexError):
        build_metadata([], [SeqSpan(3, 6, [7, 8])], BLOCK, torch.device("cpu"), torch.float32)
