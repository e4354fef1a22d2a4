"""Matmuls of a few rows (decode steps) against 16-bit weights, in Triton: out = x @ w.T (+ bias).

At batch 1-16 a linear layer is a matrix-vector product bound by how fast its weight streams from
memory. cuBLAS splits the shorter projections (o_proj, down_proj) along K and adds the parts in a second
kernel, and reaches 75-90 % of the bandwidth on an H200; these kernels give each program whole output
columns over the full K, so there is one launch and nothing to reduce. Whether they beat cuBLAS for a
shape is measured at start-up (skinny_linears.py); nothing here assumes it.

Two kinds of program: one row of activations takes float multiply-adds into a [BLOCK_N, BLOCK_K] tile
summed once at the end; several rows (padded to 16) take tensor-core dot products.
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


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    if BLOCK_M == 1:
        x_ptrs = x_ptr + k
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs)
            else:
                k_mask = k0 + k < K
                w = tl.load(w_ptrs, mask=(n[:, None] < N) & k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]
    else:
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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous), weight [N, K] contiguous -> [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    if rows == 0:
        return out
    even = k % config.block_k == 0 and n % config.block_n == 0
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, EVEN=even, BLOCK_M=block_rows(rows), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, UPCAST=INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
