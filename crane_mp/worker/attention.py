"""Paged attention, portable torch backend (CPU and CUDA): metadata built once per step, used by every layer.

A step's tokens are laid out decode-first:

    token index  0 ........ D-1 | D ............................ T-1
                 one token per   | prefill chunks, one sequence after another
                 decode sequence |   seq p: tokens [q_start_p, q_start_p + q_len_p)

Each sequence's keys live in KV blocks; key position j of a sequence sits in
slot block_table[j // block_size] * block_size + j % block_size. A prefill chunk of
q_len tokens after ctx_before cached tokens attends to keys [0, ctx_before + i] for its
query i. Decodes are attended in one batched call, prefill chunks in a second one
padded to the longest chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SeqSpan:
    """One scheduled sequence in a step: `q_len` new tokens after `ctx_before` cached ones."""

    ctx_before: int
    q_len: int
    block_table: list[int]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot each new token's K/V is written to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_keys] additive (torch path only)
    decode_ctx_lens: torch.Tensor | None  # [num_decodes] int64 keys per decode (native kernel only)
    sliding_window: int | None
    prefill_token_index: torch.Tensor | None  # [num_prefills * max_q] index into the prefill tokens
    prefill_valid_index: torch.Tensor | None  # [num_prefill_tokens] rows of the padded output to keep
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks]
    prefill_mask: torch.Tensor | None  # [num_prefills, 1, max_q, max_keys] additive
    num_prefills: int
    max_prefill_q: int
    prefill_is_fresh_single: bool  # one prefill with no cached context: plain causal attention


def _padded_tables(spans: list[SeqSpan], num_blocks_needed: list[int], device) -> torch.Tensor:
    width = max(num_blocks_needed)
    rows = [s.block_table[:n] + [0] * (width - n) for s, n in zip(spans, num_blocks_needed)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _key_mask(
    q_pos: torch.Tensor, ctx_len: torch.Tensor, num_keys: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """q_pos: [B, Q] absolute query positions; ctx_len: [B]. Returns an additive mask [B, 1, Q, num_keys].

    Additive (0 / -inf) in the model dtype, built once per step: a boolean mask would be converted by
    every layer's attention call.
    """
    keys = torch.arange(num_keys, device=q_pos.device)
    allowed = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < ctx_len[:, None, None])
    if sliding_window is not None:
        allowed &= keys[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None]


def build_metadata(
    decodes: list[SeqSpan],
    prefills: list[SeqSpan],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    native_decode: bool = False,
) -> AttentionMetadata:
    """Called by the runner once per step; `decodes` each have q_len == 1 and come first.

    With `native_decode` the decodes are attended by the C++ kernel, which reads block tables and
    context lengths directly instead of a gathered copy and a mask."""
    slots: list[int] = []
    for span in decodes + prefills:
        table = span.block_table
        for pos in range(span.ctx_before, span.ctx_before + span.q_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)

    decode_tables = decode_mask = decode_ctx_lens = None
    if decodes:
        ctx = [s.ctx_before + 1 for s in decodes]
        needed = [-(-c // block_size) for c in ctx]
        decode_tables = _padded_tables(decodes, needed, device)
        ctx_len = torch.tensor(ctx, dtype=torch.long, device=device)
        if native_decode:
            decode_ctx_lens = ctx_len
        else:
            decode_mask = _key_mask((ctx_len - 1)[:, None], ctx_len, max(needed) * block_size, sliding_window, dtype)

    token_index = valid_index = prefill_tables = prefill_mask = None
    max_q = max((s.q_len for s in prefills), default=0)
    fresh_single = len(prefills) == 1 and prefills[0].ctx_before == 0 and sliding_window is None
    if prefills and not fresh_single:
        ctx = [s.ctx_before + s.q_len for s in prefills]
        needed = [-(-c // block_size) for c in ctx]
        prefill_tables = _padded_tables(prefills, needed, device)
        index, valid, start = [], [], 0
        for p, span in enumerate(prefills):
            index += list(range(start, start + span.q_len)) + [start] * (max_q - span.q_len)
            valid += range(p * max_q, p * max_q + span.q_len)
            start += span.q_len
        token_index = torch.tensor(index, dtype=torch.long, device=device)
        valid_index = torch.tensor(valid, dtype=torch.long, device=device)
        ctx_before = torch.tensor([s.ctx_before for s in prefills], device=device)
        q_pos = ctx_before[:, None] + torch.arange(max_q, device=device)[None, :]  # [num_prefills, max_q]
        ctx_len = torch.tensor(ctx, device=device)
        prefill_mask = _key_mask(q_pos, ctx_len, max(needed) * block_size, sliding_window, dtype)

    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=len(decodes),
        decode_block_tables=decode_tables,
        decode_mask=decode_mask,
        decode_ctx_lens=decode_ctx_lens,
        sliding_window=sliding_window,
        prefill_token_index=token_index,
        prefill_valid_index=valid_index,
        prefill_block_tables=prefill_tables,
        prefill_mask=prefill_mask,
        num_prefills=len(prefills),
        max_prefill_q=max_q,
        prefill_is_fresh_single=fresh_single,
    )


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim] -> [B, kv_heads, num_keys, head_dim]."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    batch, width = tables.shape
    rows = cache.view(num_blocks, -1).index_select(0, tables.view(-1))
    return rows.view(batch, width * block_size, kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KH, D], written into the cache here, or None when the caller already
    wrote them (the fused CPU kernel). Returns [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k is not None:
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    outputs = []

    num_decodes = meta.num_decode_tokens
    if num_decodes and meta.decode_ctx_lens is not None:
        out = torch.ops.crane_mp.paged_decode_attention(
            q[:num_decodes].contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens,
            scale, meta.sliding_window or 0,
        )  # [num_decodes, H, D]
        outputs.append(out.view(num_decodes, num_heads * head_dim))
    elif num_decodes:
        # Each KV head serves its group of query heads as a small batch of queries: no K/V repeat.
        qd = q[:num_decodes].view(num_decodes, kv_heads, num_heads // kv_heads, head_dim)
        kd = _gather(k_cache, meta.decode_block_tables)
        vd = _gather(v_cache, meta.decode_block_tables)
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        outputs.append(out.reshape(num_decodes, num_heads * head_dim))

    if meta.num_prefills:
        qp = q[num_decodes:]
        if meta.prefill_is_fresh_single:
            if k is None:  # already in the cache: read this prefill's rows back
                slots = meta.slot_mapping[num_decodes:]
                kp = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
                vp = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
            else:
                kp, vp = k[num_decodes:], v[num_decodes:]
            # 4-D inputs: with 3-D ones SDPA falls back to its math backend (5-10x slower on CPU).
            out = F.scaled_dot_product_attention(
                qp.transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], is_causal=True,
                scale=scale, enable_gqa=True,
            )  # [1, H, T, D]
            outputs.append(out[0].transpose(0, 1).reshape(-1, num_heads * head_dim))
        else:
            batch, max_q = meta.num_prefills, meta.max_prefill_q
            qs = qp.index_select(0, meta.prefill_token_index).view(batch, max_q, num_heads, head_dim)
            kp = _gather(k_cache, meta.prefill_block_tables)
            vp = _gather(v_cache, meta.prefill_block_tables)
            out = F.scaled_dot_product_attention(
                qs.transpose(1, 2), kp, vp, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True
            )  # [B, H, max_q, D]
            out = out.transpose(1, 2).reshape(batch * max_q, num_heads * head_dim)
            outputs.append(out.index_select(0, meta.prefill_valid_index))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
