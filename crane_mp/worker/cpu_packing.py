"""Pre-packed bf16 linear weights for the CPU's matrix units.

A plain bf16 weight is reordered into a blocked layout on every call; packing it once at load time
is faster with identical math. Two backends:

- our AMX kernel (worker/kernels/amx_linear.cpp) when the CPU has AMX and the native kernels are
  built: ~2x oneDNN on decode-sized GEMMs; results equal up to float summation order;
- oneDNN's packed linear otherwise: ~20% faster than a plain weight at 32 rows, identical results.

The packed tensor replaces the plain weight (no second copy). An LM head tied to the embedding is
packed only for AMX, whose layout the embedding lookup can read rows back from; with oneDNN the
lookup needs the plain layout, so a tied head stays plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.kernels.cpu_isa import amx_gemm


def _amx_shape_ok(linear: nn.Linear) -> bool:
    return linear.in_features % 32 == 0 and linear.out_features % 32 == 0


def _interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [a0..a(n-1), b0..b(n-1)] -> 16-row blocks [a0-15, b0-15, a16-31, b16-31, ...]."""
    half = t.shape[0] // 2
    return t.reshape(2, half // 16, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


class PackedLinear(nn.Module):
    """With `gate_up_silu` (a gated MLP's fused gate/up projection with SiLU) and AMX, the module
    returns silu(gate) * up directly: the activation runs in the GEMM's epilogue (`silu_mul`)."""

    def __init__(self, linear: nn.Linear, gate_up_silu: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.amx = amx_gemm() and _amx_shape_ok(linear)
        self.silu_mul = self.amx and gate_up_silu
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if self.silu_mul:
            weight = _interleave_halves(weight)
            bias = None if bias is None else _interleave_halves(bias)
        packed = (
            torch.ops.crane_mp.amx_pack_weight(weight) if self.amx
            else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        )
        self.register_buffer("packed_weight", packed)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul:
            return torch.ops.crane_mp.amx_linear_silu_mul(x, self.packed_weight, self.bias)
        if self.amx:
            return torch.ops.crane_mp.amx_linear(x, self.packed_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PackedEmbedding(nn.Module):
    """Embedding lookup from an AMX-packed weight shared with the tied LM head."""

    def __init__(self, packed_weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed_weight", packed_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.crane_mp.amx_embedding(input_ids, self.packed_weight)


def pack_linear_weights(model: nn.Module) -> int:
    """Swap every nn.Linear for a PackedLinear (a tied LM head only with AMX, see above); returns how
    many were packed."""
    embeddings = {
        id(module.weight): name for name, module in model.named_modules() if isinstance(module, nn.Embedding)
    }
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        tied_embedding = embeddings.get(id(module.weight))
        if tied_embedding is not None and not (amx_gemm() and _amx_shape_ok(module)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(module, gate_up_silu=child == "gate_up_proj" and getattr(parent, "act", None) is F.silu)
        setattr(parent, child, packed)
        if tied_embedding is not None:
            _replace(model, tied_embedding, PackedEmbedding(packed.packed_weight))
        count += 1
    return count


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
