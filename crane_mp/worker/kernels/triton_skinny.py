"""Matmuls of a few rows (decode steps) against 16-bit weights, in Triton: out = x @ w.T (+ bias).

At batch 1-16 a linear layer is a matrix-vector product bound by how fast its weight streams from
memory. cuBLAS splits the shorter projections (o_proj, down_proj) along K and adds the parts in a second
kernel, and reaches 75-90 % of the bandwidth on an H200; these kernels give each program whole output
columns over the full K, so there is one launch and nothing to reduce. Whether they beat cuBLAS for a
shape is measured at start-up (skinny_linears.py); nothing here assumes it.

Two kinds of program: one row of activations takes float multiply-adds into a [BLOCK_N, BLOCK_K] tile
summed once at the end; several rows (padded to 16) take tensor-core dot products.

The input may be computed as it is read, saving a launch (and a round trip of the activations) a
projection: the RMSNorm before it, with the residual add (the row's 1/rms is one factor, applied to the
finished sums, so the input is read once), or SiLU(gate) * up before the down projection. They serve
one row (batch-1 decode, where a step's fixed costs weigh most).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from crane_mp.worker.kernels.triton_common import INTERPRETED, dot


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# What start-up tries for each weight shape and row count; the fastest (cuBLAS included) wins.
CANDIDATES = (
    SkinnyConfig(16, 512, 4, 3),
    SkinnyConfig(32, 256, 4, 4),
    SkinnyConfig(8, 1024, 4, 3),
    SkinnyConfig(64, 128, 8, 4),
)
MAX_ROWS = 16
PROLOGUE_ROWS = 1  # the input prologues serve decode steps of one sequence


@triton.jit
def _input_tile(x_ptr, res_ptr, res_out_ptr, norm_ptr, row_offsets, kk, mask, K, is_first,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The [1, BLOCK_K] tile of the projection's input row in float32, and its rows' sums of squares
    (RMS prologue: the input is x (+ residual) times the norm weight, the rows' scale applied at the end).
    The first program writes the residual sum, rounded as stored, which is what it normalises."""
    if PROLOGUE == 2:  # SiLU(gate) * up of a [rows, 2K] gate_up, rounded once as the unfused kernel does
        gate = tl.load(x_ptr + row_offsets + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row_offsets + K + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row_offsets + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    squares = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            offsets = row_offsets + kk[None, :]  # x, the residual and their sum share one row stride
            total = x + tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            stored = total.to(res_out_ptr.dtype.element_ty)
            if is_first:
                tl.store(res_out_ptr + offsets, stored, mask=mask)
            x = stored.to(tl.float32)
        squares = tl.sum(x * x, 1)
        x = x * tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    return x, squares


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, eps, M, N, K, stride_xm,
                   stride_wn, stride_om, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PROLOGUE: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    if BLOCK_M == 1:
        is_first = tl.program_id(0) == 0
        row = tl.zeros([1, 1], dtype=tl.int32)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            if EVEN:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x, tile_squares = _input_tile(x_ptr, res_ptr, res_out_ptr, norm_ptr, row, kk, kk[None, :] < K, K,
                                              is_first, PROLOGUE, HAS_RESIDUAL)
            else:
                k_mask = kk < K
                w = tl.load(w_ptrs, mask=(n[:, None] < N) & k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
                x, tile_squares = _input_tile(x_ptr, res_ptr, res_out_ptr, norm_ptr, row, kk, k_mask[None, :], K,
                                              is_first, PROLOGUE, HAS_RESIDUAL)
            squares += tile_squares
            acc += w.to(tl.float32) * x  # x: [1, BLOCK_K]
            w_ptrs += BLOCK_K
        out = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]
        if PROLOGUE == 1:
            out = out * tl.rsqrt(squares / K + eps)[:, None]
    else:  # the prologues serve one row: a [16, BLOCK_K] float32 input tile would spill
        m = tl.arange(0, BLOCK_M)
        x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
        m_mask = m[:, None] < M
        out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_mask, other=0.0)
            else:
                k_mask = k0 + k < K
                w = tl.load(w_ptrs, mask=(n[:, None] < N) & k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_mask & k_mask[None, :], other=0.0)
            out += dot(x, tl.trans(w), "ieee", UPCAST)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    rows = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (n[None, :] < N))


def block_rows(rows: int) -> int:
    """Rows a program holds: one row alone, else the 16 of a tensor-core dot product."""
    return 1 if rows == 1 else 16


def candidates_for(rows: int) -> tuple[SkinnyConfig, ...]:
    """The CANDIDATES that can serve `rows` rows: a tensor-core dot product needs 16 columns."""
    return tuple(c for c in CANDIDATES if block_rows(rows) == 1 or c.block_n >= 16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                  norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                  silu_mul: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= MAX_ROWS, rows contiguous), weight [N, K] contiguous -> [M, N] in x's dtype.

    With `norm` (weight, eps): RMSNorm(x (+ residual)) @ weight.T in one kernel, returning (out, the
    input's rows: residual + x, or x). With `silu_mul`: x is [M, 2K] gate_up, the input SiLU(gate) * up.
    Either needs M <= PROLOGUE_ROWS."""
    rows = x.shape[0]
    assert rows <= PROLOGUE_ROWS or (norm is None and not silu_mul)
    k = weight.shape[1]
    assert residual is None or residual.stride(0) == x.stride(0) == k
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    summed = x if norm is None or residual is None else torch.empty_like(x)
    if rows == 0:
        return out if norm is None else (out, summed)
    even = k % config.block_k == 0 and n % config.block_n == 0
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, residual if residual is not None else x, summed,
        norm_weight, eps, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        EVEN=even, BLOCK_M=block_rows(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST=INTERPRETED,
        PROLOGUE=1 if norm is not None else 2 if silu_mul else 0, HAS_RESIDUAL=residual is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out if norm is None else (out, summed)


def unfused_input(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
                  residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """The projection input the prologues compute, by the separate kernels the layers would launch
    instead (what start-up times cuBLAS after)."""
    from crane_mp.worker.kernels import triton_elementwise as ops

    if silu_mul:
        return ops.silu_and_mul(x)
    ops.add_rms_norm_(x, residual, norm[0], norm[1])
    return x
