"""Paged attention on CUDA in Triton: decode and prefill/extend read keys and values straight from the
block table, each KV block once per kernel, with an online softmax (flash attention) in float32.

Why Triton rather than FlashInfer: Triton ships with torch on every CUDA host we target, so there is no
second binary to match against torch and CUDA versions; our cache layout ([blocks, block_size,
kv_heads, head_dim]) is read as it is. Kernels are tested on CPU through Triton's interpreter
(tests/unit/test_triton_attention.py) against the portable torch path.

Decode is split along the context ("flash decoding") when the batch alone cannot fill the GPU: each
program attends one (sequence, KV head, split) with the whole query-head group as the rows of its dot
products, so every key is loaded once for the group; a second kernel merges the splits. The number
of splits is fixed per batch size (CUDA graphs replay fixed grids); each sequence divides its own
context among them at run time.

Soft-capped logits (Gemma 2: softcap * tanh(logits / softcap)) are capped in the kernels, in float32,
before the mask: a SOFTCAP of 0 compiles the plain kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crane_mp.worker.kernels.triton_common import INTERPRETED, dot

_DECODE_TILE = 64  # keys per inner iteration of decode
_MAX_SPLITS = 16


@triton.jit
def _capped(s, softcap):
    """softcap * tanh(s / softcap), tanh from one exponential of a non-positive argument (no overflow)."""
    e = tl.exp(-2.0 * tl.abs(s) / softcap)
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(s < 0, -t, t)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale, window, softcap, num_heads,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
    SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), TILE) * TILE
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        keys = tile_start + tl.arange(0, TILE)
        k_mask = keys < end
        blocks = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=k_mask, other=0)
        offsets = blocks.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), PRECISION, UPCAST) * scale  # [GROUP_PAD, TILE]
        if SOFTCAP:
            s = _capped(s, softcap)
        s = tl.where(k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < NUM_SPLITS
    part = (seq * num_heads + head) * NUM_SPLITS + s
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :], mask=s_mask[:, None], other=0.0)
    # Split 0 always holds keys, so the maximum is finite; empty splits (max -inf) weigh exp(-inf) = 0.
    weight = tl.exp(m - tl.max(m, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_before_ptr, limit_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
    SOFTCAP: tl.constexpr, LIMITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq).to(tl.int32)
    if m_block * BLOCK_M < q_len:
        q_start = tl.load(q_start_ptr + seq).to(tl.int32)
        ctx_before = tl.load(ctx_before_ptr + seq).to(tl.int32)
        kv_head = head // GROUP
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = ctx_before + rows
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        hi = ctx_before + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # keys [lo, hi) can be attended
        if LIMITS:  # each row's own exclusive bound: past its position inside an image attended both ways
            see = tl.load(limit_ptr + q_start + rows, mask=row_mask, other=0)
            hi = tl.maximum(hi, tl.max(see, 0))
        else:
            see = q_pos + 1
        lo = tl.where(window > 0, tl.maximum(ctx_before + m_block * BLOCK_M - window + 1, 0), 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for tile_start in range(lo, hi, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            k_valid = keys < hi
            blocks = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=k_valid, other=0)
            offsets = blocks.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            kv_mask = k_valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k), PRECISION, UPCAST) * scale  # [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                s = _capped(s, softcap)
            allowed = k_valid[None, :] & (keys[None, :] < see[:, None])
            allowed = allowed & ((window == 0) | (keys[None, :] > q_pos[:, None] - window))
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may see no allowed key in a tile (sliding window): keep its exponents finite.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _prefill_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(query rows per program, keys per inner iteration). float32 operands take the FMA path, not
    tensor cores: 64x64 tiles spill registers and overflow sm86/sm89 shared memory (99 KiB) at head
    dim 128, 32x32 do neither (tests/unit/test_triton_compile.py checks every launch)."""
    return (32, 32) if dtype == torch.float32 else (64, 64)


def _precision(dtype: torch.dtype) -> str:
    # float32 checkpoints are compared token for token with the CPU path: no TF32 rounding of q and k.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Context splits per sequence so that a decode batch keeps about two programs per SM busy."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(_MAX_SPLITS, wanted))


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, splits: int, device) -> tuple[torch.Tensor, ...]:
    """Partial results of split decode: (acc [seqs*heads*splits, D_PAD], max, sum) in float32."""
    rows = num_seqs * num_heads * splits if splits > 1 else 1
    d_pad = triton.next_power_of_2(head_dim)
    return (torch.empty(rows, d_pad, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, out: torch.Tensor, scale: float, window: int, splits: int,
                 workspace: tuple[torch.Tensor, ...], tile: int = _DECODE_TILE, num_warps: int = 4,
                 softcap: float = 0.0) -> None:
    """q: [S, H, D] one query per sequence; writes out [S, H, D]. `window` 0: no sliding window;
    `softcap` 0: logits not capped.
    `tile` (keys per inner iteration) and `num_warps`: what benchmarks/gpu_kernels.py compares."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    part_acc, part_max, part_sum = workspace
    _decode_split_kernel[(num_seqs, kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, ctx_lens, part_acc, part_max, part_sum,
        scale, window, softcap or 1.0, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        SOFTCAP=bool(softcap), NUM_SPLITS=splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1], TILE=tile, PRECISION=_precision(q.dtype), UPCAST=INTERPRETED,
        num_warps=num_warps,
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, D_PAD=d_pad,
        )


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  q_start: torch.Tensor, q_len: torch.Tensor, ctx_before: torch.Tensor, max_q: int,
                  out: torch.Tensor, scale: float, window: int, softcap: float = 0.0,
                  limits: torch.Tensor | None = None) -> None:
    """Causal attention of prefill chunks whose keys (cached context and the chunk itself) are all in
    the cache. Sequence p's queries are rows [q_start[p], q_start[p] + q_len[p]) of q and out [T, H, D].
    `limits` [T] int32: each query row sees the keys before its own bound instead of those up to its
    position (the images Gemma 3 attends both ways)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    block_m, block_n = _prefill_tiles(q.dtype)
    grid = (block_tables.shape[0], triton.cdiv(max_q, block_m), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_start, q_len, ctx_before, q_len if limits is None else limits,
        scale, window, softcap or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        SOFTCAP=bool(softcap), LIMITS=limits is not None, GROUP=group, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), UPCAST=INTERPRETED,
    )
