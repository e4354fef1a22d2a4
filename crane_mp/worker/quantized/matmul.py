"""The three ways a GGUF-quantized weight is multiplied, one class each; the worker's platform picks one
at start-up (platforms/) and the quantized layers call it, never asking which device they are on.

- TorchGGUF: portable. A slab of rows is dequantized at a time with torch ops and multiplied, never
  a whole layer at once.
- NativeGGUF: CPUs that build crane-mp's kernels. With 8-bit activations the matmul quantizes them
  per block and takes integer dot products with the weight blocks (kernels/gguf_int8.cpp, the
  default), reading Q4_K, Q6_K and Q8_0 rows repacked eight at a time (kernels/gguf_repack.cpp); with
  float activations it dequantizes inside the kernel (kernels/gguf_matmul.cpp: exact, slower).
- TritonGGUF: CUDA. Up to 64 rows of input (decode batches) dequantize inside one kernel
  (triton_dequant.py); larger ones dequantize a slab per Triton launch. A kernel that fails to compile
  or launch on an untested GPU/Triton pairing hands over to the torch ops, with one warning.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType

from crane_mp.worker.kernels.tile_check import int8_tiles
from crane_mp.worker.quantized.formats import (
    INT8_TYPES,
    Q4_0_X16,
    Q4_K_X8,
    Q4_K_X16,
    Q6_K_X8,
    Q6_K_X16,
    Q8_0_X8,
    dequantize,
)

log = logging.getLogger(__name__)

# Rows dequantized per slab: bounds the temporary to a few MB on any model.
_SLAB_ELEMENTS = 1 << 22

# The types the 8-bit-activation kernels read repacked, with their repacking op's name.
_REPACKED = {GGMLQuantizationType.Q4_K: (Q4_K_X8, "gguf_repack_q4_k_x8"),
             GGMLQuantizationType.Q6_K: (Q6_K_X8, "gguf_repack_q6_k_x8"),
             GGMLQuantizationType.Q8_0: (Q8_0_X8, "gguf_repack_q8_0_x8")}
_REPACKED_X16 = {GGMLQuantizationType.Q4_K: (Q4_K_X16, "gguf_repack_q4_k_x16"),
                 GGMLQuantizationType.Q6_K: (Q6_K_X16, "gguf_repack_q6_k_x16"),
                 GGMLQuantizationType.Q4_0: (Q4_0_X16, "gguf_repack_q4_0_x16")}


class TorchGGUF:
    """Dequantize with torch ops, a slab of rows at a time, and multiply."""

    def layout(self, qtype: int, weight: torch.Tensor, in_features: int, int8: bool) -> tuple[int, torch.Tensor]:
        """(type, rows) as this kernel reads them: as the file has them."""
        return qtype, weight

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
               int8: bool = False) -> torch.Tensor:
        """x [M, K] @ dequantize(weight).T -> [M, N] in x's dtype. `int8`: the platform chose 8-bit
        activations, which only the native kernels take."""
        rows = weight.shape[0]
        if rows == 0:
            return x.new_empty(x.shape[0], 0)
        slab = max(1, _SLAB_ELEMENTS // max(1, in_features))
        # Each slab's product goes straight into its columns of the output (BLAS writes a strided
        # block): a list of parts joined by torch.cat would hold the output twice at the step's peak.
        out = x.new_empty(x.shape[0], rows)
        for start in range(0, rows, slab):
            dense = self.dequantize_slab(weight[start : start + slab], qtype, in_features, x.dtype)
            torch.mm(x, dense.T, out=out[:, start : start + dense.shape[0]])
        return out

    def grouped_matmul(self, x: torch.Tensor, weights: list[torch.Tensor], rows: list[int], qtype: int,
                       in_features: int, int8: bool = False) -> torch.Tensor:
        """A mixture's experts: x's rows in runs, run i of rows[i] rows times weights[i] (alike in shape
        and type) -> [sum(rows), N] in x's dtype."""
        out = x.new_empty(x.shape[0], weights[0].shape[0])
        start = 0
        for weight, count in zip(weights, rows):
            out[start : start + count] = self.matmul(x[start : start + count], weight, qtype, in_features, int8)
            start += count
        return out

    def matmul_parts(self, x: torch.Tensor, parts: list[tuple[int, torch.Tensor]], in_features: int,
                     int8: bool = False) -> torch.Tensor:
        """x [M, K] times each part's rows (type, weight), the outputs side by side: [M, sum of rows]."""
        outs = [self.matmul(x, weight, qtype, in_features, int8) for qtype, weight in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def gate_up_silu(self, x: torch.Tensor, gate: tuple[int, torch.Tensor], up: tuple[int, torch.Tensor],
                     in_features: int, int8: bool = False) -> torch.Tensor | None:
        """silu(x @ gate.T) * (x @ up.T) for a gated MLP's two parts (type, weight), as matmul_parts and
        then silu_and_mul compute it, in one call; None where these kernels have no such call."""
        return None

    def moe_token(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_type: int, down: torch.Tensor, down_type: int) -> torch.Tensor | None:
        """One token [1, H] through its SiLU-gated experts ids [k] weighted by gates [k], stacks
        gate_up [E, 2I, .] and down [E, H, .] with 8-bit activations, in one call; None where these
        kernels have no such call (the caller runs the experts' own steps)."""
        return None

    def dequantize_slab(self, weight: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(weight, qtype, in_features).to(dtype)

    def dequantize_rows(self, weight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """float32 [rows, in_features] (embedding lookups)."""
        return self.dequantize_slab(weight, qtype, in_features, torch.float32)


class NativeGGUF(TorchGGUF):
    """crane-mp's C++ kernels (torch.ops.crane_mp), float32 accumulation."""

    def __init__(self) -> None:
        # 512-bit kernels: Q4_K and Q4_0 with AVX512-VNNI, Q6_K with VBMI's bit-field unpacking besides;
        # their groups take prompts through the AMX-INT8 tiles where those pass their check
        self.x16 = {qtype for qtype in _REPACKED_X16 if torch.ops.crane_mp.gguf_x16_supported(qtype)}
        int8_tiles()

    def layout(self, qtype: int, weight: torch.Tensor, in_features: int, int8: bool) -> tuple[int, torch.Tensor]:
        """For 8-bit activations, Q4_K, Q6_K and Q8_0 rows repacked eight at a time (1.3-1.7x in batched
        steps and prompts), Q4_K, Q6_K and Q4_0 sixteen at a time where the CPU has their x16 kernels'
        instructions (Q4_0: 3.3-5.7x its row kernel at 2-256 rows on Zen 4); any other type, or a row count
        that is no multiple of 8 (16 for Q4_0), as the file has them."""
        if int8 and qtype in self.x16 and weight.shape[0] % 16 == 0:
            packed_type, op = _REPACKED_X16[qtype]
            return packed_type, getattr(torch.ops.crane_mp, op)(weight, in_features)
        if int8 and qtype in _REPACKED and weight.shape[0] % 8 == 0:
            packed_type, op = _REPACKED[qtype]
            return packed_type, getattr(torch.ops.crane_mp, op)(weight, in_features)
        return qtype, weight

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
               int8: bool = False) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):  # the kernels' activation types
            return super().matmul(x, weight, qtype, in_features)
        if int8 and qtype in INT8_TYPES:
            return torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, in_features)
        return torch.ops.crane_mp.gguf_linear(x, weight, qtype, in_features)

    def grouped_matmul(self, x: torch.Tensor, weights: list[torch.Tensor], rows: list[int], qtype: int,
                       in_features: int, int8: bool = False) -> torch.Tensor:
        """With 8-bit activations, one kernel call for every run: the activations quantized once, both
        cores on the experts' tiles at once."""
        if int8 and qtype in INT8_TYPES and x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.crane_mp.gguf_grouped_linear_int8(x, weights, rows, qtype, in_features)
        return super().grouped_matmul(x, weights, rows, qtype, in_features, int8)

    def matmul_parts(self, x: torch.Tensor, parts: list[tuple[int, torch.Tensor]], in_features: int,
                     int8: bool = False) -> torch.Tensor:
        """With 8-bit activations, a layer's parts (q, k and v; gate and up) in one kernel call: a decode
        step's in one pass over them for both cores, and each part's output written into its columns
        (joined by torch.cat, a prompt's gate and up outputs cost 4 % of an 8B model's prefill)."""
        if (int8 and len(parts) > 1 and x.dtype in (torch.float32, torch.bfloat16)
                and all(qtype in INT8_TYPES for qtype, _ in parts)):
            return torch.ops.crane_mp.gguf_linear_parts_int8(x, [weight for _, weight in parts],
                                                             [qtype for qtype, _ in parts], in_features)
        return super().matmul_parts(x, parts, in_features, int8)

    def gate_up_silu(self, x: torch.Tensor, gate: tuple[int, torch.Tensor], up: tuple[int, torch.Tensor],
                     in_features: int, int8: bool = False) -> torch.Tensor | None:
        """With 8-bit activations, each thread's columns of both parts into buffers that stay in its L2, SiLU
        applied there: a prompt's [M, 2I] projection is never written out and read back (0.77x the time
        of matmul_parts and silu_and_mul for an 8B model's gate and up at 1,024 rows)."""
        (gate_type, gate_rows), (up_type, up_rows) = gate, up
        if (not int8 or gate_type not in INT8_TYPES or up_type not in INT8_TYPES
                or gate_rows.shape[0] != up_rows.shape[0] or x.dtype not in (torch.float32, torch.bfloat16)):
            return None
        return torch.ops.crane_mp.gguf_gate_up_silu_int8(x, gate_rows, up_rows, gate_type, up_type, in_features)

    def moe_token(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_type: int, down: torch.Tensor, down_type: int) -> torch.Tensor | None:
        if gate_up_type not in INT8_TYPES or down_type not in INT8_TYPES or x.dtype not in (torch.float32,
                                                                                              torch.bfloat16):
            return None
        return torch.ops.crane_mp.gguf_moe_token_int8(x, ids, gates, gate_up, gate_up_type, down, down_type)

    def dequantize_rows(self, weight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        return torch.ops.crane_mp.gguf_dequantize(weight, qtype, in_features)


class TritonGGUF(TorchGGUF):
    """triton_dequant.py's kernels for the types they decode, the torch ops for the rest and after a
    kernel failed once (they have not yet run on every GPU)."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels  # the triton_dequant module
        self.failed = False

    def _for(self, qtype: int):
        return None if self.failed or qtype not in self.kernels.TRITON_TYPES else self.kernels

    def _fall_back(self, err: Exception) -> None:
        """A compile or launch error: torch ops from now on. Running out of memory is not the kernel's
        fault, and after a device fault nothing runs: those propagate."""
        # Imported here: the platforms package imports this module.
        from crane_mp.worker.platforms.device import is_device_fault

        if isinstance(err, torch.OutOfMemoryError) or is_device_fault(err):
            raise err
        self.failed = True
        log.warning("Triton GGUF kernel failed (%s); using torch ops", str(err).splitlines()[0][:200])

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
               int8: bool = False) -> torch.Tensor:
        kernels = self._for(qtype)
        if kernels is not None and 0 < weight.shape[0] and x.shape[0] <= kernels.FUSED_MAX_ROWS:
            try:  # decode: the weight's bytes bound the step, so they are read once, dequantized in place
                return kernels.triton_quantized_matmul(x.contiguous(), weight, qtype, in_features)
            except Exception as err:
                self._fall_back(err)
        return super().matmul(x, weight, qtype, in_features)

    def dequantize_slab(self, weight: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        kernels = self._for(qtype)
        if kernels is not None:
            try:
                return kernels.triton_dequantize(weight, qtype, in_features, dtype)
            except Exception as err:
                self._fall_back(err)
        return super().dequantize_slab(weight, qtype, in_features, dtype)
