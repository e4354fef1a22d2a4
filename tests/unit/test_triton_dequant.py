"""The CUDA path's Triton GGUF kernels (dequantizer, and the matmul that decodes weights in registers),
run on CPU through Triton's interpreter, against the gguf package's dequantizer for every quantized
type they serve. Skipped where Triton is not installed."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted_together

pytest.importorskip("triton")

_IMPORTS = """
import gguf, numpy as np, torch
from gguf import GGMLQuantizationType as T
from crane_mp.worker.quantized.triton_dequant import TRITON_TYPES, triton_dequantize, triton_quantized_matmul
from tests.unit.test_gguf_kernels import cols_for, quantized, reference
"""

_DEQUANTIZE = _IMPORTS + """
for qtype in sorted(TRITON_TYPES):
    for rows, cols in [(3, cols_for(qtype)[0]), (37, cols_for(qtype)[1])]:
        data = quantized(qtype, rows, cols, seed=rows)
        for dtype in (torch.float32, torch.bfloat16):
            got = triton_dequantize(torch.from_numpy(data.copy()), qtype, cols, dtype)
            want = reference(data, qtype, cols).to(dtype)
            assert got.dtype == dtype and got.shape == (rows, cols)
            # The interpreter narrows to bf16 by truncation (GPUs round to nearest): one bf16 step apart.
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-7, msg=T(qtype).name)
print("dequantized", len(TRITON_TYPES))
"""

_MATMUL = _IMPORTS + """
types = sorted(TRITON_TYPES)[half::2]
for qtype in types:
    cols = cols_for(qtype)[1]
    data = quantized(qtype, 70, cols, seed=3)  # 70 outputs: a partial tile of 64
    weight = reference(data, qtype, cols)
    # One partial row tile, one full, three tiles; K split as sized for 4 SMs, or not split, or 5 asked:
    # K=544 gives 5 chunks, the last a partial tile; K=768 gives 4 even chunks of 3 tiles.
    for rows, splits in ((1, None), (5, 1), (16, None), (37, 5)):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            got = triton_quantized_matmul(x.to(dtype), torch.from_numpy(data.copy()), qtype, cols, splits)
            want = x.to(dtype).float() @ weight.to(dtype).float().T
            assert got.dtype == dtype and got.shape == (rows, 70)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * cols ** 0.5, msg=T(qtype).name)
print("multiplied", len(types))
"""


# Every served type, both dtypes and the matmul through the interpreter: half a minute of one core's work,
# the dequantizer and each half of the types' matmuls in a process of its own, at once. tests/gpu runs the
# same kernels on a device.
@pytest.mark.slow
def test_triton_dequantize_equals_gguf_in_the_interpreter():
    dequantized, *multiplied = run_interpreted_together(_DEQUANTIZE, *(f"half = {h}\n" + _MATMUL for h in (0, 1)))
    assert "dequantized 8" in dequantized and [m.split()[-1] for m in multiplied] == ["4", "4"]


def test_k_splits_fill_the_sms_with_whole_tiles():
    from crane_mp.worker.quantized.triton_dequant import k_splits

    # An 8B model's 4096x4096 projection at batch 1 on an H100: 128 output tiles, 64 K tiles of 64.
    assert k_splits(128, 64, 132) == 5  # 13 tiles a chunk, the last 12
    assert k_splits(128 * 4, 64, 132) == 2  # batch 64: four row tiles
    assert k_splits(4 * 132, 64, 132) == 1  # already four programs an SM
    assert k_splits(152064 // 32, 64, 132) == 1  # the LM head
    assert k_splits(1, 3, 132) == 3  # never more chunks than K tiles
    for programs in range(1, 300, 7):
        for k_tiles in range(1, 200, 13):
            splits = k_splits(programs, k_tiles, 132)
            chunk = -(-k_tiles // splits)
            assert 1 <= splits <= k_tiles and (splits - 1) * chunk < k_tiles  # no empty chunk
