"""Triton kernels for GGUF rows on CUDA: the decode matmul that dequantizes in registers, and slab
dequantization (one launch per slab of rows, in the compute dtype) for cuBLAS to multiply.

Q8_0, Q4_K, Q5_K and Q6_K (BLOCKWISE_TYPES, the formats of Q8_0 and Q*_K_M files) are read a block
at a time: each 32-value slice of a row's block lies in 32 consecutive bytes, loaded whole and
decoded in registers (_slice). The older 32-element formats use a per-element decoder in which
every element reads the bytes of its own block (scales, its quant bits): the same code serves every
layout, at several loads an element. Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1,
tests/unit/test_triton_dequant.py) and on an H200 (tests/gpu, benchmarks/gguf_cuda_splits.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from crane_mp.worker.kernels.triton_common import INTERPRETED, dot
from crane_mp.worker.platforms.device import num_sms
from crane_mp.worker.quantized.formats import LAYOUTS

TRITON_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
_BLOCK = 1024


@triton.jit
def _u8(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offset, mask):
    bits = (_u8(ptr, offset, mask) | (_u8(ptr, offset + 1, mask) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _values(w_ptr, row, col, row_bytes, mask, QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """float32 weights at (row, col), any shape of index tensors; masked elements read byte 0."""
    base = row * row_bytes + (col // QK) * BLOCK_BYTES
    j = col % QK
    if QTYPE == 8:  # Q8_0: f16 d, 32 int8
        q = _u8(w_ptr, base + 2 + j, mask)
        value = _f16(w_ptr, base, mask) * tl.where(q > 127, q - 256, q).to(tl.float32)
    elif QTYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d
        h = j // 128
        s = (j % 128) // 32
        l = j % 32
        low = (_u8(w_ptr, base + 64 * h + 32 * (s % 2) + l, mask) >> (4 * (s // 2))) & 0xF
        high = (_u8(w_ptr, base + 128 + 32 * h + l, mask) >> (2 * s)) & 3
        scale = _u8(w_ptr, base + 192 + j // 16, mask)
        scale = tl.where(scale > 127, scale - 256, scale).to(tl.float32)
        value = _f16(w_ptr, base + 208, mask) * scale * ((low | (high << 4)) - 32).to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: f16 d, f16 dmin, 12 scale bytes, (qh[32]), qs[128]
        sub = j // 32
        l = j % 32
        lo_sub = sub < 4
        # Sub-block j < 4: scale s[j] & 63, min s[j+4] & 63; else the low/high nibbles of s[j+4]
        # with the top two bits of s[j-4] (scale) and s[j] (min).
        first = _u8(w_ptr, base + 4 + tl.where(lo_sub, sub, sub + 4), mask)
        second = _u8(w_ptr, base + 4 + tl.where(lo_sub, sub + 4, sub - 4), mask)
        own = _u8(w_ptr, base + 4 + sub, mask)
        scale = tl.where(lo_sub, first & 63, (first & 0xF) | ((second >> 6) << 4))
        minimum = tl.where(lo_sub, second & 63, (first >> 4) | ((own >> 6) << 4))
        if QTYPE == 13:
            q = (_u8(w_ptr, base + 48 + 32 * (sub // 2) + l, mask) >> (4 * (sub % 2))) & 0xF
            q = q | (((_u8(w_ptr, base + 16 + l, mask) >> sub) & 1) << 4)
        else:
            q = (_u8(w_ptr, base + 16 + 32 * (sub // 2) + l, mask) >> (4 * (sub % 2))) & 0xF
        value = (_f16(w_ptr, base, mask) * scale.to(tl.float32) * q.to(tl.float32)
                 - _f16(w_ptr, base + 2, mask) * minimum.to(tl.float32))
    else:  # Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7): 32 elements, nibble j % 16, high half j >= 16
        d = _f16(w_ptr, base, mask)
        if QTYPE == 2:
            value = d * (((_u8(w_ptr, base + 2 + j % 16, mask) >> (4 * (j // 16))) & 0xF) - 8).to(tl.float32)
        elif QTYPE == 3:
            q = (_u8(w_ptr, base + 4 + j % 16, mask) >> (4 * (j // 16))) & 0xF
            value = d * q.to(tl.float32) + _f16(w_ptr, base + 2, mask)
        elif QTYPE == 6:  # fifth bits: bit j of a little-endian uint32 after d
            q = (_u8(w_ptr, base + 6 + j % 16, mask) >> (4 * (j // 16))) & 0xF
            q = q | (((_u8(w_ptr, base + 2 + j // 8, mask) >> (j % 8)) & 1) << 4)
            value = d * (q - 16).to(tl.float32)
        else:
            q = (_u8(w_ptr, base + 8 + j % 16, mask) >> (4 * (j // 16))) & 0xF
            q = q | (((_u8(w_ptr, base + 4 + j // 8, mask) >> (j % 8)) & 1) << 4)
            value = d * q.to(tl.float32) + _f16(w_ptr, base + 2, mask)
    return value


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, n_elements, K, row_bytes, QTYPE: tl.constexpr, QK: tl.constexpr,
                    BLOCK_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n_elements
    value = _values(w_ptr, e // K, e % K, row_bytes, mask, QTYPE, QK, BLOCK_BYTES)
    tl.store(out_ptr + e, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om, stride_os, chunk_tiles,
                   QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[s, M, N] = x[M, K] @ W[N, K].T over the s-th chunk of chunk_tiles K tiles, s the third grid
    axis, with W decoded tile by tile in registers: the quantized bytes are the only weight traffic
    (decode steps, a few rows of x, are bound by it)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    # Chunks of whole tiles: the compiler then knows every tile starts at a multiple of BLOCK_K and loads
    # a GGUF block's scales once per tile, not per element (214 registers instead of 64 for Q4_K).
    k_begin = tl.program_id(2) * chunk_tiles * BLOCK_K
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + chunk_tiles * BLOCK_K, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _values(w_ptr, rn[:, None], rk[None, :], row_bytes, n_mask[:, None] & k_mask[None, :], QTYPE, QK,
                    BLOCK_BYTES)
        acc += dot(x, tl.trans(w.to(x.dtype)), "ieee", UPCAST)
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def triton_dequantize(weight: torch.Tensor, qtype: int, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """weight: [N, row_bytes] uint8 GGUF rows -> [N, elements] in `dtype`, on weight's device."""
    if qtype in BLOCKWISE_TYPES:
        return _blockwise_dequantize(weight, qtype, elements, dtype)
    layout = LAYOUTS[qtype]
    out = torch.empty(weight.shape[0], elements, dtype=dtype, device=weight.device)
    total = out.numel()
    if total:
        _dequant_kernel[(triton.cdiv(total, _BLOCK),)](
            weight, out, total, elements, weight.shape[1], QTYPE=int(qtype), QK=layout.block,
            BLOCK_BYTES=layout.bytes, BLOCK=_BLOCK,
        )
    return out


@triton.jit
def _scale_min_k(w_ptr, base, mask, SUB: tl.constexpr):
    """Q4_K/Q5_K sub-block SUB's 6-bit scale and min, [rows] float32. Sub-block j < 4: scale s[j] & 63,
    min s[j+4] & 63; else the low/high nibbles of s[j+4] with the top two bits of s[j-4] (scale) and
    s[j] (min)."""
    if SUB < 4:
        scale = _u8(w_ptr, base + 4 + SUB, mask) & 63
        minimum = _u8(w_ptr, base + 8 + SUB, mask) & 63
    else:
        packed = _u8(w_ptr, base + 8 + SUB, mask)
        scale = (packed & 0xF) | ((_u8(w_ptr, base + SUB, mask) >> 6) << 4)
        minimum = (packed >> 4) | ((_u8(w_ptr, base + 4 + SUB, mask) >> 6) << 4)
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _slice(w_ptr, base, mask, QTYPE: tl.constexpr, J: tl.constexpr):
    """float32 [rows, 32]: values 32J..32J+31 of each row's block at byte offsets `base` [rows], decoded
    from whole runs of its bytes (32 quant bytes a row, each row's scales once), for Q8_0, Q4_K, Q5_K
    and Q6_K, whose every 32-value slice lies in 32 consecutive bytes (two slices share one run of
    nibbles: a repeated load of it is served by L1)."""
    lane = tl.arange(0, 32)
    tile = base[:, None] + lane[None, :]
    tile_mask = mask[:, None]
    if QTYPE == 8:  # Q8_0: f16 d, 32 int8
        q = tl.load(w_ptr + tile + 2, mask=tile_mask, other=0).to(tl.int8, bitcast=True)
        value = _f16(w_ptr, base, mask)[:, None] * q.to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: f16 d, f16 dmin, 12 scale bytes, (qh[32]), qs[128]
        if QTYPE == 13:
            q = (_u8(w_ptr, tile + 48 + 32 * (J // 2), tile_mask) >> (4 * (J % 2))) & 0xF
            q = q | (((_u8(w_ptr, tile + 16, tile_mask) >> J) & 1) << 4)
        else:
            q = (_u8(w_ptr, tile + 16 + 32 * (J // 2), tile_mask) >> (4 * (J % 2))) & 0xF
        scale, minimum = _scale_min_k(w_ptr, base, mask, J)
        value = ((_f16(w_ptr, base, mask) * scale)[:, None] * q.to(tl.float32)
                 - (_f16(w_ptr, base + 2, mask) * minimum)[:, None])
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d; slice J = 4h + s of half h
        h = J // 4
        s = J % 4
        low = (_u8(w_ptr, tile + 64 * h + 32 * (s % 2), tile_mask) >> (4 * (s // 2))) & 0xF
        q = (low | (((_u8(w_ptr, tile + 128 + 32 * h, tile_mask) >> (2 * s)) & 3) << 4)) - 32
        first = _u8(w_ptr, base + 192 + 2 * J, mask)  # one int8 scale per 16 values
        second = _u8(w_ptr, base + 193 + 2 * J, mask)
        scale = tl.where(lane[None, :] < 16, first[:, None], second[:, None])
        scale = tl.where(scale > 127, scale - 256, scale).to(tl.float32)
        value = _f16(w_ptr, base + 208, mask)[:, None] * scale * q.to(tl.float32)
    return value


@triton.jit
def _block_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om, stride_os, chunk_blocks,
                         QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """out[s, M, N] = x[M, K] @ W[N, K].T over the s-th chunk of chunk_blocks GGUF blocks (BLOCKWISE_TYPES):
    BLOCK_N weight rows decoded a 32-value slice at a time (_slice), each slice multiplied with the
    activations' matching 32 columns. The quantized bytes are the only weight traffic."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm + tl.arange(0, 32)[None, :]
    first = tl.program_id(2) * chunk_blocks
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in range(first, tl.minimum(first + chunk_blocks, K // QK)):
        base = rn * row_bytes + b * BLOCK_BYTES  # [BLOCK_N] byte offsets of each row's block b
        for j in tl.static_range(QK // 32):
            x = tl.load(x_rows + b * QK + 32 * j, mask=m_mask[:, None], other=0.0)
            w = _slice(w_ptr, base, n_mask, QTYPE, j)
            acc += dot(x, tl.trans(w.to(x.dtype)), "ieee", UPCAST)
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _block_dequant_kernel(w_ptr, out_ptr, N, K, row_bytes, QTYPE: tl.constexpr, QK: tl.constexpr,
                          BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[N, K] = W decoded: program (i, b) writes block b of rows i*BLOCK_N.., 32 values a store."""
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = rn < N
    b = tl.program_id(1)
    base = rn * row_bytes + b * BLOCK_BYTES
    out = out_ptr + rn[:, None] * K + b * QK + tl.arange(0, 32)[None, :]
    for j in tl.static_range(QK // 32):
        w = _slice(w_ptr, base, n_mask, QTYPE, j)
        tl.store(out + 32 * j, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


# Tile of the fused matmul: 16 rows of x (tl.dot's minimum), 32 output features, 64 inputs per step.
# Decoding a 64x128 weight tile spills registers for most formats (checked by compiling every format,
# tests/unit/test_triton_compile.py). Up to FUSED_MAX_ROWS rows (decode batches) each weight tile is
# decoded once per 16 rows, from cache after the first; past that (prefill) a dequantized slab through
# cuBLAS is cheaper.
FUSED_MAX_ROWS = 64
_TILE_M = 16
_TILE_N = 32
_TILE_K = 64
# Programs wanted per SM: one, as an 8B model's 4096-wide projections give at batch 1, keeps too few
# weight loads in flight to stream memory. Q8_0, Q4_K and Q6_K need <=102 registers a thread, so four
# 4-warp programs fit (benchmarks/RESULTS.md; tests/unit/test_triton_compile.py holds it).
_PROGRAMS_PER_SM = 4


def k_splits(programs: int, k_tiles: int, sms: int) -> int:
    """How many chunks of whole K tiles each output tile's inputs are split into, so that the grid
    keeps about _PROGRAMS_PER_SM programs on every SM."""
    wanted = max(1, min(k_tiles, -(-_PROGRAMS_PER_SM * sms // max(1, programs))))
    chunk_tiles = -(-k_tiles // wanted)
    return -(-k_tiles // chunk_tiles)


def triton_quantized_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
                            splits: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequantize(weight [N, row_bytes]).T -> [M, N]. `splits`: K chunks,
    by default as k_splits sizes them for the device; partial sums are added in float32."""
    if qtype in BLOCKWISE_TYPES:
        return _blockwise_matmul(x, weight, qtype, in_features, splits)
    layout = LAYOUTS[qtype]
    rows, cols = x.shape[0], weight.shape[0]
    grid_m, grid_n, k_tiles = triton.cdiv(rows, _TILE_M), triton.cdiv(cols, _TILE_N), triton.cdiv(in_features, _TILE_K)
    if splits is None:
        splits = k_splits(grid_m * grid_n, k_tiles, num_sms(x.device))
    chunk_tiles = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, chunk_tiles)
    if splits == 1:
        out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, rows, cols, dtype=torch.float32, device=x.device)
    _matmul_kernel[(grid_m, grid_n, splits)](
        x, weight, out, rows, cols, in_features, weight.shape[1], x.stride(0), out.stride(-2),
        out.stride(0) if splits > 1 else 0, chunk_tiles, QTYPE=int(qtype), QK=layout.block, BLOCK_BYTES=layout.bytes,
        BLOCK_M=_TILE_M, BLOCK_N=_TILE_N, BLOCK_K=_TILE_K, UPCAST=INTERPRETED,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)


# The formats _block_matmul_kernel decodes a block at a time (those of Q8_0 and Q4_K_M files, and
# Q5_K_M's); the older 32-element formats keep the per-element decoder above.
BLOCKWISE_TYPES = frozenset({T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
# Weight rows a program: [rows, 32] byte tiles, 16 rows of x (tl.dot's minimum) against them. Q6_K
# decodes from two byte tiles and two scale vectors a slice: at 64 rows it needs 175 registers a
# thread, past the 128 that _PROGRAMS_PER_SM allows (tests/unit/test_triton_compile.py), at 32 rows 102.
BLOCK_ROWS = {T.Q8_0: 64, T.Q4_K: 64, T.Q5_K: 64, T.Q6_K: 32}


def blockwise_splits(rows: int, cols: int, qtype: int, in_features: int, device: torch.device,
                     block_rows: int | None = None) -> int:
    """K chunks (of whole blocks) of the block matmul of x [rows, in_features] with `cols` weight rows."""
    programs = triton.cdiv(rows, _TILE_M) * triton.cdiv(cols, block_rows or BLOCK_ROWS[qtype])
    return k_splits(programs, in_features // LAYOUTS[qtype].block, num_sms(device))


def _blockwise_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
                      splits: int | None, block_rows: int | None = None) -> torch.Tensor:
    """`block_rows`: weight rows a program, BLOCK_ROWS' by default (benchmarks/gguf_cuda_splits.py
    compares others)."""
    layout = LAYOUTS[qtype]
    rows, cols = x.shape[0], weight.shape[0]
    block_rows = block_rows or BLOCK_ROWS[qtype]
    grid_m, grid_n, blocks = triton.cdiv(rows, _TILE_M), triton.cdiv(cols, block_rows), in_features // layout.block
    if splits is None:
        splits = blockwise_splits(rows, cols, qtype, in_features, x.device, block_rows)
    chunk_blocks = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, chunk_blocks)
    if splits == 1:
        out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, rows, cols, dtype=torch.float32, device=x.device)
    _block_matmul_kernel[(grid_m, grid_n, splits)](
        x, weight, out, rows, cols, in_features, weight.shape[1], x.stride(0), out.stride(-2),
        out.stride(0) if splits > 1 else 0, chunk_blocks, QTYPE=int(qtype), QK=layout.block,
        BLOCK_BYTES=layout.bytes, BLOCK_M=_TILE_M, BLOCK_N=block_rows, UPCAST=INTERPRETED,
    )
    return out if splits == 1 else out.sum(0).to(x.dtype)


def _blockwise_dequantize(weight: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    layout = LAYOUTS[qtype]
    rows = weight.shape[0]
    out = torch.empty(rows, in_features, dtype=dtype, device=weight.device)
    if rows and in_features:
        _block_dequant_kernel[(triton.cdiv(rows, _DEQUANT_ROWS), in_features // layout.block)](
            weight, out, rows, in_features, weight.shape[1], QTYPE=int(qtype), QK=layout.block,
            BLOCK_BYTES=layout.bytes, BLOCK_N=_DEQUANT_ROWS,
        )
    return out


_DEQUANT_ROWS = 32
