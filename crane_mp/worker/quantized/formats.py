"""GGML tensor types crane-mp serves, their block layouts, and a portable torch dequantizer.

Quantized weights stay in memory as each row's GGUF blocks, unchanged ([N, row_bytes] uint8). The
CPU kernels (kernels/gguf_matmul.cpp) dequantize inside the matmul; this module is the portable
path (CUDA, or CPU without native kernels), which dequantizes a bounded slab of rows at a time.
Layouts follow llama.cpp's ggml-common.h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T


@dataclass(frozen=True, slots=True)
class BlockLayout:
    block: int  # elements per block
    bytes: int  # bytes per block


LAYOUTS: dict[int, BlockLayout] = {
    T.F32: BlockLayout(1, 4),
    T.F16: BlockLayout(1, 2),
    T.BF16: BlockLayout(1, 2),
    T.Q4_0: BlockLayout(32, 18),
    T.Q4_1: BlockLayout(32, 20),
    T.Q5_0: BlockLayout(32, 22),
    T.Q5_1: BlockLayout(32, 24),
    T.Q8_0: BlockLayout(32, 34),
    T.Q4_K: BlockLayout(256, 144),
    T.Q5_K: BlockLayout(256, 176),
    T.Q6_K: BlockLayout(256, 210),
    T.MXFP4: BlockLayout(32, 17),
}

# Rows repacked eight (or sixteen) at a time for the 8-bit-activation kernels (kernels/gguf_repack.cpp):
# our own ids, past ggml's. Q4_K_X8 and Q4_K_X16 are [rows, 148 bytes per 256 columns]; Q6_K_X8,
# Q6_K_X16, Q8_0_X8 and Q4_0_X16 keep their type's bytes (210 per 256, 34 and 18 per 32).
Q4_K_X8 = 0x10000 + T.Q4_K
Q6_K_X8 = 0x10000 + T.Q6_K
Q8_0_X8 = 0x10000 + T.Q8_0
Q4_K_X16 = 0x20000 + T.Q4_K
Q6_K_X16 = 0x20000 + T.Q6_K
Q4_0_X16 = 0x20000 + T.Q4_0
# Types whose CPU matmuls may run on 8-bit activations (kernels/gguf_int8.cpp); float types never do.
INT8_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, Q4_K_X8, Q6_K_X8,
                       Q8_0_X8, Q4_K_X16, Q6_K_X16, Q4_0_X16})
# MXFP4's codes as values, doubled to integers (its block scale is then 2^(e - 128)).
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[..., n] uint8 -> [..., count, n]: bit i of every byte in row i."""
    shifts = torch.arange(count, device=packed.device, dtype=torch.uint8).view(count, 1)
    return (packed.unsqueeze(-2) >> shifts) & 1


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes -> 8 six-bit scales and 8 six-bit mins, as float32."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _dequantize_blocks(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """b: [num_blocks, block_bytes] uint8 -> [num_blocks, block_elements] float32."""
    n = b.shape[0]
    if qtype == T.Q8_0:
        return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()
    if qtype in (T.Q4_0, T.Q4_1):
        start = 2 if qtype == T.Q4_0 else 4
        q = _nibbles(b[:, start:]).reshape(n, 32).float()
        if qtype == T.Q4_0:
            return _f16(b[:, :2]) * (q - 8)
        return _f16(b[:, :2]) * q + _f16(b[:, 2:4])
    if qtype in (T.Q5_0, T.Q5_1):
        start = 2 if qtype == T.Q5_0 else 4
        high = _bits(b[:, start : start + 4], 8).transpose(-1, -2).reshape(n, 32)  # bit i of the uint32 -> element i
        q = (_nibbles(b[:, start + 4 :]).reshape(n, 32) | (high << 4)).float()
        if qtype == T.Q5_0:
            return _f16(b[:, :2]) * (q - 16)
        return _f16(b[:, :2]) * q + _f16(b[:, 2:4])
    if qtype in (T.Q4_K, T.Q5_K):
        scales, mins = _k_scales(b[:, 4:16])
        d = _f16(b[:, 0:2]) * scales  # [n, 8]
        m = _f16(b[:, 2:4]) * mins
        if qtype == T.Q4_K:
            q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
        else:
            q = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32) | (_bits(b[:, 16:48], 8) << 4)
        return (d.unsqueeze(-1) * q.float() - m.unsqueeze(-1)).reshape(n, 256)
    if qtype == T.Q6_K:
        low = _nibbles(b[:, :128].reshape(n, 2, 2, 32)).transpose(2, 3).reshape(n, 2, 4, 32)
        shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).view(4, 1)  # no host copy: graph-safe
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
        q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        return (_f16(b[:, 208:210]) * scales).unsqueeze(-1).mul(q).reshape(n, 256)
    if qtype == T.MXFP4:
        values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)
        q = values[_nibbles(b[:, 1:]).reshape(n, 32).long()]
        return torch.ldexp(q, b[:, :1].int() - 128)
    raise ValueError(f"no dequantizer for GGML type {qtype}")


def dequantize(weight: torch.Tensor, qtype: int, elements: int) -> torch.Tensor:
    """weight: [N, row_bytes] uint8 GGUF rows -> [N, elements] float32, on weight's device."""
    rows = weight.shape[0]
    if qtype == T.F32:
        return weight.view(torch.float32).reshape(rows, elements)
    if qtype in (T.F16, T.BF16):
        return weight.view(torch.float16 if qtype == T.F16 else torch.bfloat16).reshape(rows, elements).float()
    layout = LAYOUTS[qtype]
    blocks = weight.reshape(-1, layout.bytes)
    return _dequantize_blocks(blocks, qtype).reshape(rows, elements)
