"""Our numpy K-quant quantizers, read back through the gguf package's dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from crane_mp.testing import kquants

QUANTIZERS = {T.Q4_K: (kquants.quantize_q4_k, 15), T.Q5_K: (kquants.quantize_q5_k, 31), T.Q6_K: (kquants.quantize_q6_k, 63)}


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: T(t).name)
def test_error_is_within_the_quantization_step(qtype):
    quantize, levels = QUANTIZERS[qtype]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 512)).astype(np.float32) * rng.uniform(0.05, 4.0, (12, 1)).astype(np.float32)
    data = quantize(x)
    assert data.shape == (12, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1]) and data.dtype == np.uint8
    back = gguf.quants.dequantize(data, qtype).reshape(x.shape)
    # Per 256-block: the range spread over `levels` steps, plus the 6-/8-bit rounding of the scales.
    blocks = x.reshape(-1, 256)
    step = (blocks.max(axis=1) - np.minimum(blocks.min(axis=1), 0)) / levels
    err = np.abs(back - x).reshape(-1, 256).max(axis=1)
    assert np.all(err <= 1.5 * step), (err / step).max()
    assert np.corrcoef(back.ravel(), x.ravel())[0, 1] > {T.Q4_K: 0.99, T.Q5_K: 0.997, T.Q6_K: 0.999}[qtype]


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: T(t).name)
def test_values_on_the_grid_round_trip_exactly(qtype):
    """Blocks on a grid whose super-block scale is a power of two come back bit for bit: every
    bit-field (scales, mins, high bits, nibble order) must land where the dequantizer reads it."""
    quantize, levels = QUANTIZERS[qtype]
    rng = np.random.default_rng(1)
    signed = qtype == T.Q6_K
    low, high = (-31, 31) if signed else (0, levels)
    q = rng.integers(low, high + 1, size=(4, 256))
    q[:, 0], q[:, 1] = low, high  # pin every sub-block's range so its scale is exact
    q = q.reshape(4, -1, 16 if signed else 32)
    q[:, :, 0], q[:, :, 1] = low, high
    step = (127 if signed else 63) / 1024  # sub-block scale = step, super-block scale = 1/1024 exactly
    x = (q.reshape(4, 256) * step).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x), qtype).reshape(x.shape)
    np.testing.assert_array_equal(back, x)


def test_zero_block_is_zero():
    for qtype, (quantize, _) in QUANTIZERS.items():
        back = gguf.quants.dequantize(quantize(np.zeros((2, 256), np.float32)), qtype)
        assert not np.any(back), T(qtype).name
