"""Linear and embedding layers over GGUF-quantized weights, kept in their file's block layout.

A fused projection (q/k/v, gate/up) may mix types (a Q4_K_M file stores some attn_v rows in Q6_K):
each part keeps its own type and the outputs are concatenated. On CPU with native kernels the matmul
quantizes the activations to 8 bits and takes integer dot products with the weight blocks
(kernels/gguf_int8.cpp, the default), or with float activations dequantizes inside the kernel
(kernels/gguf_matmul.cpp: exact, slower); CUDA dequantizes in its kernel for up to 64 rows of input
(decode batches; triton_dequant.py). Elsewhere a slab of rows is dequantized at a time (on CUDA by one
Triton launch, else with torch ops) and multiplied, never a whole layer at once.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from crane_mp.worker.device import is_device_fault
from crane_mp.worker.kernels.cpu_isa import native_ops
from crane_mp.worker.quantized.formats import INT8_TYPES, Q4_K_X8, Q6_K_X8, Q8_0_X8, dequantize

log = logging.getLogger(__name__)

# Rows dequantized per slab on the portable path: bounds the temporary to a few MB on any model.
_SLAB_ELEMENTS = 1 << 22


def _native(x: torch.Tensor) -> bool:
    return native_ops(x.device) and x.dtype in (torch.float32, torch.bfloat16)


_triton_state: dict[str, bool] = {}


def _triton_kernels(weight: torch.Tensor, qtype: int):
    """The Triton module for a CUDA weight of a type it decodes, or None where Triton is missing or one of
    its kernels failed once (they have not yet run on a GPU: a failure falls back to the torch ops with
    one warning)."""
    if not weight.is_cuda or _triton_state.get("failed"):
        return None
    try:
        from crane_mp.worker.quantized import triton_dequant
    except ImportError:
        return None
    return triton_dequant if qtype in triton_dequant.TRITON_TYPES else None


def _triton_failed(err: Exception) -> None:
    """A compile or launch error on an untested GPU/Triton pairing: torch ops from now on. Running out
    of memory is not the kernel's fault, and after a device fault nothing runs: those propagate."""
    if isinstance(err, torch.OutOfMemoryError) or is_device_fault(err):
        raise err
    _triton_state["failed"] = True
    log.warning("Triton GGUF kernel failed (%s); using torch ops", str(err).splitlines()[0][:200])


def _dequantize_slab(weight: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    kernels = _triton_kernels(weight, qtype)
    if kernels is not None:
        try:
            return kernels.triton_dequantize(weight, qtype, in_features, dtype)
        except Exception as err:
            _triton_failed(err)
    return dequantize(weight, qtype, in_features).to(dtype)


def quantized_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
                     int8: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T -> [M, N] in x's dtype, float32 accumulation on CPU. `int8`: the
    caller chose 8-bit activations (cpu_isa.int8_matmuls), which quantized types then get."""
    if _native(x):
        if int8 and qtype in INT8_TYPES:
            return torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, in_features)
        return torch.ops.crane_mp.gguf_linear(x, weight, qtype, in_features)
    rows = weight.shape[0]
    if rows == 0:
        return x.new_empty(x.shape[0], 0)
    kernels = _triton_kernels(weight, qtype)
    if kernels is not None and x.shape[0] <= kernels.FUSED_MAX_ROWS:  # decode: weight bytes bound the step
        try:
            return kernels.triton_quantized_matmul(x.contiguous(), weight, qtype, in_features)
        except Exception as err:
            _triton_failed(err)
    slab = max(1, _SLAB_ELEMENTS // max(1, in_features))
    parts = [
        x @ _dequantize_slab(weight[start : start + slab], qtype, in_features, x.dtype).T
        for start in range(0, rows, slab)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


# The types the 8-bit-activation kernels read repacked, with their repacking op's name.
_REPACKED = {GGMLQuantizationType.Q4_K: (Q4_K_X8, "gguf_repack_q4_k_x8"),
             GGMLQuantizationType.Q6_K: (Q6_K_X8, "gguf_repack_q6_k_x8"),
             GGMLQuantizationType.Q8_0: (Q8_0_X8, "gguf_repack_q8_0_x8")}


def kernel_layout(qtype: int, weight: torch.Tensor, in_features: int, int8: bool) -> tuple[int, torch.Tensor]:
    """(type, rows) as the chosen kernel reads them: for 8-bit activations, Q4_K, Q6_K and Q8_0 rows
    repacked eight at a time (kernels/gguf_repack.cpp: 1.3-1.7x in batched steps and prompts); any other type,
    or a row count that is no multiple of 8, as the file has them."""
    if int8 and qtype in _REPACKED and weight.shape[0] % 8 == 0 and weight.device.type == "cpu":
        packed_type, op = _REPACKED[qtype]
        return packed_type, getattr(torch.ops.crane_mp, op)(weight, in_features)
    return qtype, weight


def dequantize_rows(weight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    if native_ops(weight.device):
        return torch.ops.crane_mp.gguf_dequantize(weight, qtype, in_features)
    return _dequantize_slab(weight, qtype, in_features, torch.float32)


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias), W given as row groups [(ggml type, uint8 [rows, row_bytes]), ...]; `int8`:
    8-bit activations (chosen once, at load, by cpu_isa.int8_matmuls)."""

    def __init__(self, in_features: int, parts: list[tuple[int, torch.Tensor]], bias: nn.Parameter | None,
                 int8: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.int8 = int8
        self.qtypes = [qtype for qtype, _ in parts]
        self.out_features = 0
        for index, (_, weight) in enumerate(parts):
            self.register_buffer(f"qweight_{index}", weight)
            self.out_features += weight.shape[0]
        self.bias = bias

    def weights(self) -> list[tuple[int, torch.Tensor]]:
        return [(qtype, getattr(self, f"qweight_{i}")) for i, qtype in enumerate(self.qtypes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        outs = [quantized_matmul(flat, weight, qtype, self.in_features, self.int8) for qtype, weight in self.weights()]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, types={self.qtypes}, "
                f"int8={self.int8}")


class GGUFEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the looked-up rows (the table may be shared with a tied head)."""

    def __init__(self, qtype: int, weight: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.dim, self.dtype = qtype, dim, dtype
        self.register_buffer("qweight", weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, input_ids.reshape(-1))
        return dequantize_rows(rows, self.qtype, self.dim).to(self.dtype).reshape(*input_ids.shape, self.dim)
