"""Reference numpy quantizers for the K-quant types the gguf package can only dequantize (Q4_K, Q5_K, Q6_K).

Plain round-to-nearest with per-sub-block scales (llama.cpp searches scales iteratively; files made
here are fixtures, not production quantizations). Bit layouts are llama.cpp's (ggml-common.h); the
tests check every output through the gguf package's own dequantizer.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> llama.cpp's 12-byte packing."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _scale_min_blocks(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Affine 6-bit scales/mins for 8 sub-blocks of 32; returns (q, d, dmin, scales, mins)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(-lo.min(axis=-1) / 63)
    scales = np.clip(np.rint(_safe_div(scale, d[:, None].astype(np.float32))), 0, 63)
    mins = np.clip(np.rint(_safe_div(-lo, dmin[:, None].astype(np.float32))), 0, 63)
    step = d[:, None].astype(np.float32) * scales
    offset = dmin[:, None].astype(np.float32) * mins
    q = np.clip(np.rint(_safe_div(sub + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return q, d, dmin, scales, mins


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x: [rows, cols] float32 (cols % 256 == 0) -> [rows, cols / 256 * 144] uint8."""
    rows = x.shape[0]
    q, d, dmin, scales, mins = _scale_min_blocks(x.astype(np.float32).reshape(-1, QK_K), 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(scales, mins), qs], axis=1
    )
    return blocks.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """x: [rows, cols] float32 (cols % 256 == 0) -> [rows, cols / 256 * 176] uint8."""
    rows = x.shape[0]
    q, d, dmin, scales, mins = _scale_min_blocks(x.astype(np.float32).reshape(-1, QK_K), 31)
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    high = (q >> 4) & 1  # [blocks, 8, 32]: bit j of byte l is sub-block j's fifth bit
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(scales, mins), qh, qs],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x: [rows, cols] float32 (cols % 256 == 0) -> [rows, cols / 256 * 210] uint8."""
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(scale.max(axis=-1) / 127)
    scales = np.clip(np.rint(_safe_div(scale, d[:, None].astype(np.float32))), -128, 127)
    step = d[:, None].astype(np.float32) * scales
    q = (np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # Within each 128-element half: sub-chunks 0/1 fill the low nibbles of bytes 0-63, 2/3 the high ones.
    ql = ((q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)).reshape(-1, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    blocks = np.concatenate(
        [ql, qh.reshape(-1, 64), scales.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(rows, -1)
