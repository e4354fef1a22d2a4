"""Fused elementwise ops of the CUDA forward pass, in Triton, with the CPU kernels' contracts
(fused_elementwise.cpp, qkv_rope_cache.cpp): same arguments, same results, one rounding per value.

Each op reads and writes its tensors once instead of the 3-6 launches of the unfused torch ops:
RMSNorm (with the residual add fused in), SiLU*mul, everything between the QKV projection and
attention (per-head q/k norm, rope, the KV-cache write), and the Gated DeltaNet decode step (one pass
over each sequence's recurrent state, in place). Tested on CPU through Triton's interpreter
(tests/unit/test_triton_elementwise.py) against the portable torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crane_mp.worker.kernels import triton_moe

# The layers receive this module as their ops: a mixture's experts find their grouped matmuls here.
grouped_experts = triton_moe


@triton.jit
def _inverse_rms(sum_of_squares, dim, eps):
    """1 / sqrt(mean + eps), each step rounded once as on the CPU (tl.sqrt and / are approximate on GPUs)."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_of_squares, dim) + eps))


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, dim, stride_x, stride_r, stride_o, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        total = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        stored = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, stored, mask=mask)
        x = stored.to(tl.float32)  # normalise the residual as stored, as the unfused ops would
    inv = _inverse_rms(tl.sum(x * x, 0), dim.to(tl.float32), eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, norm_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_ptr, eps,
                           stride_qkv, stride_rope, num_heads, num_kv_heads,
                           HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + token * stride_qkv
    slot = tl.load(slot_ptr + token)
    if head >= num_heads + num_kv_heads:  # a value head: copied into the cache as it is
        v_head = head - num_heads - num_kv_heads
        value = tl.load(row + (num_heads + num_kv_heads + v_head) * HEAD_DIM + d)
        tl.store(v_cache_ptr + (slot * num_kv_heads + v_head) * HEAD_DIM + d, value)
    else:
        partner = (d + HEAD_DIM // 2) % HEAD_DIM  # rotate-half reads the other half; sin carries its sign
        x = tl.load(row + head * HEAD_DIM + d).to(tl.float32)
        x_partner = tl.load(row + head * HEAD_DIM + partner).to(tl.float32)
        if NORM == 1:  # before rope (Qwen3)
            inv = _inverse_rms(tl.sum(x * x, 0), HEAD_DIM * 1.0, eps)
            x = x * inv * tl.load(norm_ptr + head * HEAD_DIM + d).to(tl.float32)
            x_partner = x_partner * inv * tl.load(norm_ptr + head * HEAD_DIM + partner).to(tl.float32)
        cos = tl.load(cos_ptr + token * stride_rope + d).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_rope + d).to(tl.float32)
        y = x * cos + x_partner * sin
        if NORM == 2:  # after rope (Hunyuan)
            inv = _inverse_rms(tl.sum(y * y, 0), HEAD_DIM * 1.0, eps)
            y = y * inv * tl.load(norm_ptr + head * HEAD_DIM + d).to(tl.float32)
        if head < num_heads:
            tl.store(q_ptr + (token * num_heads + head) * HEAD_DIM + d, y.to(q_ptr.dtype.element_ty))
        else:
            dst = k_cache_ptr + (slot * num_kv_heads + head - num_heads) * HEAD_DIM + d
            tl.store(dst, y.to(k_cache_ptr.dtype.element_ty))


@triton.jit
def _gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr, heads, key_dim,
                             value_dim, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (sequence, head) and a block of value columns: each column of S updates on its own."""
    item = tl.program_id(0).to(tl.int64)  # sequence * heads + head
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    col_mask, row_mask = cols < value_dim, rows < key_dim
    slot = tl.load(slot_ptr + item // heads)
    tile = state_ptr + ((slot * heads + item % heads) * key_dim + rows[:, None]) * value_dim + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    s = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + item * key_dim + rows, mask=row_mask, other=0.0)
    k = tl.load(k_ptr + item * key_dim + rows, mask=row_mask, other=0.0)
    v = tl.load(v_ptr + item * value_dim + cols, mask=col_mask, other=0.0)
    decay = tl.exp(tl.load(g_ptr + item))
    delta = (v - decay * tl.sum(s * k[:, None], 0)) * tl.load(beta_ptr + item)
    s = decay * s + k[:, None] * delta[None, :]
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + item * value_dim + cols, tl.sum(s * q[:, None], 0), mask=col_mask)


_DELTA_BLOCK_V = 32


def gated_delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The Gated DeltaNet decode step (the CPU op's contract, gated_delta.cpp): q, k [B, H, K] and v
    [B, H, V] float32, g and beta [B, H]; state [slots, H, K, V] updated in place at `slots` [B];
    returns out [B, H, V] float32."""
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    out = torch.empty(batch, heads, value_dim, dtype=torch.float32, device=q.device)
    if batch:
        _gated_delta_step_kernel[(batch * heads, triton.cdiv(value_dim, _DELTA_BLOCK_V))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, slots, out,
            heads, key_dim, value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=_DELTA_BLOCK_V)
    return out


def supports_head_dim(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    """One program normalises a row: a decode step has few rows, so wide rows get more warps (16
    values per thread) to finish sooner."""
    return max(4, min(16, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x.contiguous())
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, rows.shape[1], rows.stride(0), rows.stride(0),
                                           out.stride(0), eps, ADD_RESIDUAL=False, BLOCK=block,
                                           num_warps=_norm_warps(block))
    return out.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x; x = rms_norm(residual) * weight, both in place (contiguous rows)."""
    rows, res = _rows(x), _rows(residual)
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, rows, rows.shape[1], rows.stride(0), res.stride(0),
                                           rows.stride(0), eps, ADD_RESIDUAL=True, BLOCK=block,
                                           num_warps=_norm_warps(block))


_SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up.contiguous())
    inter = rows.shape[1] // 2
    out = rows.new_empty(rows.shape[0], inter)
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, _SILU_BLOCK))](
            rows, out, inter, rows.stride(0), out.stride(0), BLOCK=_SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], inter)


def qkv_rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm_weight: torch.Tensor | None,
                   qk_norm_position: int, eps: float, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q/k norm (qk_norm_position 0: none, 1: before rope, 2: after), rope and the KV-cache write in one
    pass over qkv [T, (H + 2 KH) D]; returns q [T, H, D]. cos/sin: [T, 1, D] or [T, D] rope rows (sin
    signed as in rope.py). The head dim must be a power of two (supports_head_dim)."""
    num_tokens = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    qkv = qkv.contiguous()
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    q = qkv.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens:
        norm = qk_norm_weight if qk_norm_weight is not None else qkv
        _qkv_rope_cache_kernel[(num_tokens, num_heads + 2 * kv_heads)](
            qkv, cos, sin, norm, slot_mapping, k_cache, v_cache, q, eps, qkv.stride(0), cos.stride(0),
            num_heads, kv_heads, HEAD_DIM=head_dim, NORM=qk_norm_position,
        )
    return q
