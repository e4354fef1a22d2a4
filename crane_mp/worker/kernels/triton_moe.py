"""A mixture's experts on CUDA in two grouped matmuls, with no host synchronisation: the step's (token,
expert) pairs are sorted by expert on the device into blocks of BLOCK_M pairs, each block one expert's
(padded with pairs that read and write nothing), and one program multiplies a block's rows by a tile of
its expert's matrix. The block count has a bound known before routing (every expert's padding at most),
so the launch grid has a fixed size, as a captured CUDA graph needs; programs past the used blocks return
at once. Checked on CPU under Triton's interpreter (tests/unit/test_triton_moe.py) and compiled for sm86
and sm90 (tests/unit/test_triton_compile.py); on a device, once a process against per-pair matmuls.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from crane_mp.worker.kernels.triton_common import INTERPRETED, dot

log = logging.getLogger(__name__)


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, n, k, rows_per_x,
    stride_x, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = (pairs // rows_per_x).to(tl.int64)  # a pair reads its token's row, or its own
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=valid[:, None] & (ks[None, :] < k),
                        other=0.0)
            b = tl.load(w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
                        + ks[:, None], mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
            acc += dot(a, b, PRECISION, UPCAST)
        out = out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))


def _tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(pairs a block, output columns a program, K a step): float32 operands take the FMA path, whose
    tiles must stay small to keep within registers (tests/unit/test_triton_compile.py)."""
    return (16, 32, 32) if dtype == torch.float32 else (16, 64, 64)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class PairBlocks:
    """A step's (token, expert) pairs sorted by expert into blocks: `pairs` [num_blocks * BLOCK_M] holds
    pair indices (token * top_k + choice; num_pairs where a block is padded), `experts` [num_blocks] each
    block's expert (-1 past the used blocks)."""

    def __init__(self, ids: torch.Tensor, num_experts: int, block_m: int) -> None:
        flat = ids.reshape(-1)
        self.num_pairs = flat.numel()
        device = flat.device
        # scatter_add, not bincount: bincount sizes its output by the largest id, a read on the host.
        counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
            0, flat, torch.ones_like(flat))
        padded = (counts + block_m - 1) // block_m * block_m
        ends = padded.cumsum(0)
        starts = ends - padded
        num_blocks = (self.num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
        order = flat.argsort(stable=True)
        first = counts.cumsum(0) - counts  # each expert's first place in `order`
        expert_of = flat[order]
        slot = starts[expert_of] + torch.arange(self.num_pairs, device=device) - first[expert_of]
        self.pairs = torch.full((num_blocks * block_m,), self.num_pairs, dtype=torch.int64, device=device)
        self.pairs.scatter_(0, slot, order)
        block_starts = torch.arange(num_blocks, device=device) * block_m
        owner = torch.searchsorted(ends, block_starts, right=True)
        self.experts = torch.where(block_starts < ends[-1], owner, -1).to(torch.int32)
        self.counts = counts
        self.block_m = block_m


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, blocks: PairBlocks, rows_per_x: int) -> torch.Tensor:
    """[num_pairs, N]: row p is x[p // rows_per_x] @ weights[expert of p].T, weights [experts, N, K]."""
    n, k = weights.shape[1], weights.shape[2]
    block_m, block_n, block_k = _tiles(x.dtype)
    assert block_m == blocks.block_m and x.stride(1) == 1 and weights.stride(2) == 1
    out = torch.empty(blocks.num_pairs, n, dtype=x.dtype, device=x.device)
    grid = (blocks.experts.shape[0], triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x, weights, out, blocks.pairs, blocks.experts, blocks.num_pairs, n, k, rows_per_x,
        x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype), UPCAST=INTERPRETED,
    )
    return out


def block_rows(dtype: torch.dtype) -> int:
    """Pairs a block of grouped_matmul holds for operands of `dtype`."""
    return _tiles(dtype)[0]


@functools.cache
def verified(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped_matmul computes what one matmul a pair does on this device, checked once a process
    on a small problem: where it does not (a compiler or device this kernel was not built for), the
    experts keep one matmul an expert, and the log says so once."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(40)]).to(device)
    x = torch.randn(40, 96, generator=gen).to(device, dtype)
    weights = torch.randn(6, 80, 96, generator=gen).to(device, dtype)
    try:
        got = grouped_matmul(x, weights, PairBlocks(ids, 6, block_rows(dtype)), 2).float()
    except Exception as err:  # noqa: BLE001 - any failure of the kernel means: do not use it
        log.warning("grouped expert matmuls unavailable on %s (%s): one matmul an expert", device, err)
        return False
    flat = ids.reshape(-1)
    want = torch.einsum("pk,pnk->pn", x.float().repeat_interleave(2, 0), weights[flat].float())
    good = torch.allclose(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)
    if not good:
        log.warning("grouped expert matmuls disagree with per-expert matmuls on %s: one matmul an expert", device)
    return good
