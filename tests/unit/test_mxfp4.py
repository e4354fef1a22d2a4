"""MXFP4 as gpt-oss's checkpoints store it, against transformers' dequantizer, and as GGUF rows."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from crane_mp.worker.quantized.formats import dequantize
from crane_mp.worker.quantized.mxfp4 import dequantize_mxfp4, ggml_rows, quantize_mxfp4


def _blocks(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 1  # subnormal block scales
    return blocks, scales


def test_dequantized_values_are_transformers():
    blocks, scales = _blocks()
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, columns, rows]
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales).transpose(1, 2), reference, rtol=0, atol=0)


def test_gguf_rows_hold_the_same_values():
    blocks, scales = _blocks(1)
    rows = ggml_rows(blocks, scales)
    assert rows.shape == (3, 10, 4 * 17)
    got = dequantize(rows.reshape(30, -1), T.MXFP4, 128).reshape(3, 10, 128)
    torch.testing.assert_close(got, dequantize_mxfp4(blocks, scales), rtol=0, atol=0)


def test_quantizing_rounds_each_value_to_its_block_s_nearest_code():
    gen = torch.Generator().manual_seed(2)
    weights = torch.randn(5, 64, generator=gen) * torch.logspace(-3, 2, 5)[:, None]
    blocks, scales = quantize_mxfp4(weights)
    values = dequantize_mxfp4(blocks, scales)
    step = torch.ldexp(torch.ones(5, 2), scales.int() - 127).repeat_interleave(32, dim=1)
    assert ((values - weights).abs() <= step + 1e-12).all()  # within one code step of the block scale
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values)), values)  # MXFP4 values are fixed points
