"""Quantized matmuls against the gguf package's own dequantizer: (dequantize(W) @ x.T) for every
served type, odd shapes and batch 1 to 64, through the native CPU kernels (at the tier this process
runs: CI runs the suite again under CRANE_MP_ISA=avx2) and the portable torch path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.testing import kquants
from crane_mp.worker.kernels.cpu_isa import kernel_isa
from crane_mp.worker.quantized.formats import LAYOUTS, dequantize
from crane_mp.worker.quantized.layers import GGUFEmbedding, GGUFLinear
from crane_mp.worker.quantized.matmul import NativeGGUF, TorchGGUF, TritonGGUF

_K_QUANTIZERS = {T.Q4_K: kquants.quantize_q4_k, T.Q5_K: kquants.quantize_q5_k, T.Q6_K: kquants.quantize_q6_k}
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.F16, T.BF16, T.F32]
native = pytest.mark.skipif(kernel_isa() is None, reason="native kernels disabled or not built")


def quantized(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8 GGUF rows of a random matrix (with a few large rows, as real weights have)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3.0, (rows, 1)).astype(np.float32)
    if qtype in _K_QUANTIZERS:
        return _K_QUANTIZERS[qtype](w)
    if qtype == T.F32:
        return w.view(np.uint8)
    if qtype == T.F16:
        return w.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(w, qtype)


def reference(data: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    if qtype == T.F32:
        return torch.from_numpy(data.view(np.float32).copy())
    if qtype == T.F16:
        return torch.from_numpy(data.view(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(-1, cols))


def cols_for(qtype: int) -> list[int]:
    block = LAYOUTS[qtype].block
    return [256, 768] if block == 256 else [96, 544]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_portable_dequantize_equals_gguf(qtype):
    for cols in cols_for(qtype):
        data = quantized(qtype, 19, cols)
        ours = dequantize(torch.from_numpy(data.copy()), qtype, cols)
        torch.testing.assert_close(ours, reference(data, qtype, cols), rtol=1e-6, atol=1e-7)


@native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_native_dequantize_equals_gguf(qtype):
    for cols in cols_for(qtype):
        data = quantized(qtype, 23, cols, seed=1)
        ours = torch.ops.crane_mp.gguf_dequantize(torch.from_numpy(data.copy()), qtype, cols)
        torch.testing.assert_close(ours, reference(data, qtype, cols), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernels", [pytest.param(NativeGGUF, marks=native), TorchGGUF], ids=["native", "portable"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_matmul_equals_dequantize_then_matmul(qtype, kernels):
    rng = np.random.default_rng(3)
    for rows, cols in [(37, cols_for(qtype)[0]), (301, cols_for(qtype)[1])]:
        data = quantized(qtype, rows, cols, seed=rows)
        weight = torch.from_numpy(data.copy())
        dense = reference(data, qtype, cols).double()
        for batch in (1, 2, 4, 5, 17, 64):
            x = torch.from_numpy(rng.standard_normal((batch, cols)).astype(np.float32))
            want = (x.double() @ dense.T).float()
            got = kernels().matmul(x, weight, qtype, cols)
            assert got.shape == (batch, rows) and got.dtype == torch.float32
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=f"batch {batch} shape {rows}x{cols}")


def test_portable_matmul_writes_each_slab_into_its_columns(monkeypatch):
    """Slabs of 75 rows of 64 inputs: 301 rows take five, the last a single row."""
    monkeypatch.setattr("crane_mp.worker.quantized.matmul._SLAB_ELEMENTS", 75 * 64)
    data = quantized(T.Q8_0, 301, 96, seed=5)[:, : 2 * 34]  # the first 64 columns: two Q8_0 blocks a row
    dense = reference(data, T.Q8_0, 64).double()
    x = torch.randn(7, 64, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    got = TorchGGUF().matmul(x, torch.from_numpy(np.ascontiguousarray(data)), T.Q8_0, 64)
    torch.testing.assert_close(got, (x.double() @ dense.T).float(), rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


class FailingKernels:
    """Stands in for the Triton GGUF module on a GPU where its kernels raise `err`."""

    FUSED_MAX_ROWS = 64
    TRITON_TYPES = frozenset({T.Q8_0})

    def __init__(self, err: Exception) -> None:
        self.err = err

    def triton_quantized_matmul(self, *args):
        raise self.err

    def triton_dequantize(self, *args):
        raise self.err


@pytest.mark.parametrize("batch", [3, 65])  # the fused decode kernel, then the per-slab dequantizer
def test_a_kernel_that_fails_to_compile_falls_back_but_out_of_memory_and_device_faults_propagate(batch):
    data = quantized(T.Q8_0, 40, 256)
    weight = torch.from_numpy(data.copy())
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(0))
    for err in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")):
        kernels = TritonGGUF(FailingKernels(err))
        with pytest.raises(type(err)):
            kernels.matmul(x, weight, T.Q8_0, 256)
        assert not kernels.failed  # still Triton's to run once memory is back
    kernels = TritonGGUF(FailingKernels(RuntimeError("out of resource: shared memory, Required: 240000")))
    got = kernels.matmul(x, weight, T.Q8_0, 256)
    assert kernels.failed
    torch.testing.assert_close(got, x @ reference(data, T.Q8_0, 256).T, rtol=1e-4, atol=1e-4)
    assert kernels.matmul(x, weight, T.Q8_0, 256).equal(got)  # the torch ops from then on


@native
@pytest.mark.parametrize("batch", [1, 9])
def test_bf16_activations_return_bf16(batch):
    data = quantized(T.Q4_K, 40, 256)
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(0))
    got = torch.ops.crane_mp.gguf_linear(x.bfloat16(), torch.from_numpy(data.copy()), T.Q4_K, 256)
    want = x.bfloat16().float() @ reference(data, T.Q4_K, 256).T
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_linear_with_mixed_parts_and_bias_matches_dense():
    """A fused q/k/v whose parts have different types (as Q4_K_M's attn_v does)."""
    parts = [(T.Q4_K, quantized(T.Q4_K, 16, 256, 0)), (T.Q6_K, quantized(T.Q6_K, 8, 256, 1)),
             (T.Q8_0, quantized(T.Q8_0, 8, 256, 2))]
    bias = torch.nn.Parameter(torch.randn(32))
    layer = GGUFLinear(256, [(t, torch.from_numpy(d.copy())) for t, d in parts], bias, TorchGGUF())
    dense = torch.cat([reference(d, t, 256) for t, d in parts])
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(layer(x), x @ dense.T + bias, rtol=1e-4, atol=1e-4)


def test_embedding_dequantizes_only_looked_up_rows():
    data = quantized(T.Q6_K, 50, 256)
    table = reference(data, T.Q6_K, 256)
    embed = GGUFEmbedding(T.Q6_K, torch.from_numpy(data.copy()), 256, torch.float32, TorchGGUF())
    ids = torch.tensor([0, 49, 7, 7])
    torch.testing.assert_close(embed(ids), table[ids], rtol=1e-6, atol=1e-7)


@native
def test_bad_weight_shape_is_an_error_not_a_crash():
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.crane_mp.gguf_linear(torch.randn(1, 256), torch.zeros(4, 100, dtype=torch.uint8), T.Q4_K, 256)
    with pytest.raises(RuntimeError, match="at least one column"):
        torch.ops.crane_mp.gguf_linear(torch.randn(9, 0), torch.zeros(4, 0, dtype=torch.uint8), T.Q8_0, 0)


@native
def test_many_slabs_under_inference_mode():
    """Enough rows for several slabs per thread, called as the worker calls it (inference tensors)."""
    data = quantized(T.Q4_K, 2048, 1024, seed=5)
    with torch.inference_mode():
        x = torch.randn(33, 1024)
        got = torch.ops.crane_mp.gguf_linear(x, torch.from_numpy(data.copy()), T.Q4_K, 1024)
    want = x @ reference(data, T.Q4_K, 1024).T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
