"""MXFP4 (OCP microscaling), as gpt-oss's checkpoints store their experts: blocks of 32 values, each a
4-bit float (e2m1, two to a byte, the low nibble first) times the block's power of two (one E8M0 byte,
bias 127). A checkpoint names a matrix's halves `<name>_blocks` [..., rows, columns / 32, 16] and
`<name>_scales` [..., rows, columns / 32]."""

from __future__ import annotations

import torch

# The e2m1 values of the 16 codes: sign bit, then magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, columns / 32, 16] codes and [..., rows, columns / 32] exponents -> float32 [..., rows, columns]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # low nibble first
    values = torch.ldexp(values.flatten(-2), scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's [..., rows, columns / 32, 16] codes and [..., rows, columns / 32] exponents -> GGUF's
    MXFP4 rows [..., rows, columns / 32 * 17]: each block its exponent byte, then element l's code in
    the low nibble of byte l (l < 16) or the high nibble of byte l - 16 (the checkpoint pairs elements
    2j and 2j + 1 in byte j). The values are the same: GGUF doubles the codes' values and halves the scale."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., groups, 32] in element order
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat([scales[..., None], packed], dim=-1).flatten(-2)


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., rows, columns] -> (blocks, scales) whose dequantization is the nearest MXFP4 matrix
    (each block's smallest scale at which its largest magnitude fits 6, then each value rounded to the
    nearest code: no value is clipped)."""
    if weights.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs columns in blocks of {BLOCK}, not {weights.shape[-1]}")
    grouped = weights.float().unflatten(-1, (-1, BLOCK))
    peak = grouped.abs().amax(dim=-1)
    exponent = torch.where(peak > 0, torch.ceil(torch.log2(peak.clamp(min=2.0**-126) / 6)), torch.zeros_like(peak))
    exponent = exponent.clamp(-127, 127)
    scaled = grouped / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)  # [..., groups, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)
