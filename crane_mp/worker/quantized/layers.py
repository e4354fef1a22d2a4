"""Linear, embedding and expert layers over GGUF-quantized weights, kept in their file's block layout.

A fused projection (q/k/v, gate/up) may mix types (a Q4_K_M file stores some attn_v rows in Q6_K):
each part keeps its own type and the outputs are concatenated. The multiplications are the kernels
the worker's platform chose (quantized/matmul.py), handed to each layer when it is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.layouts import ExpertLayout
from crane_mp.worker.models.moe import RoutedExperts
from crane_mp.worker.quantized.matmul import TorchGGUF


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias), W given as row groups [(ggml type, uint8 [rows, row_bytes]), ...] laid out
    as `kernels` read them (their `layout`); `int8`: 8-bit activations (the platform's choice)."""

    def __init__(self, in_features: int, parts: list[tuple[int, torch.Tensor]], bias: nn.Parameter | None,
                 kernels: TorchGGUF, int8: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.kernels = kernels
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
        y = self.kernels.matmul_parts(x.reshape(-1, self.in_features), self.weights(), self.in_features, self.int8)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def silu_mul_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gated MLP's gate/up projection (two parts, gate then up) with SiLU(gate) * up applied, in one
        kernel call; None where the kernels have none for these parts, or a bias comes between."""
        if len(self.qtypes) != 2 or self.bias is not None:
            return None
        gate, up = self.weights()
        y = self.kernels.gate_up_silu(x.reshape(-1, self.in_features), gate, up, self.in_features, self.int8)
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, types={self.qtypes}, "
                f"int8={self.int8}")


class GGUFExperts(RoutedExperts):
    """A layer's experts over GGUF-quantized weights: per projection part, every expert's rows as
    `kernels` lay them out, in one tensor [experts, rows, row bytes] (gate and up one part where the
    file gives them one type); a step's experts go through the kernels' grouped matmul, one call per
    part. One allocation per part lies in 2 MiB pages (prefer_huge_pages), which a step's experts
    stream faster than 1-2 MB tensors of their own."""

    def __init__(self, hidden_size: int, intermediate_size: int, gate_up: list[tuple[int, torch.Tensor]],
                 down: tuple[int, torch.Tensor], kernels: TorchGGUF, int8: bool, act, ops=None,
                 layout: ExpertLayout | None = None) -> None:
        super().__init__(down[1].shape[0], hidden_size, intermediate_size, act, ops, layout)
        self.hidden_size, self.kernels, self.int8 = hidden_size, kernels, int8
        self.gate_up_types = [qtype for qtype, _ in gate_up]
        self.down_type = down[0]
        for index, (_, stack) in enumerate([*gate_up, down]):
            self.register_buffer(f"qweight_{index}", stack)
        self._gate_up = [list(stack.unbind()) for _, stack in gate_up]  # [part][expert]: the kernels' views
        self._down = list(down[1].unbind())
        # A lone token's SiLU-gated experts in one kernel call where the kernels have one (8-bit activations,
        # gate and up one matrix, no biases): a decode step of one stream otherwise spends a dozen small ops a
        # layer around its two expert matmuls.
        self._one_call = int8 and len(gate_up) == 1 and act is F.silu and self.swiglu is None and \
            self.gate_up_bias is None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self._one_call and ids.shape[0] == 1:
            out = self.kernels.moe_token(x, ids[0], weights[0], self.qweight_0, self.gate_up_types[0], self.qweight_1,
                                         self.down_type)
            if out is not None:
                if self.routed is not None:
                    self.routed[ids[0].tolist()] += 1
                return out
        return super().forward(x, ids, weights)

    def project_gate_up(self, rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        parts = [self.kernels.grouped_matmul(rows, [weights[e] for e in experts], counts, qtype, self.hidden_size,
                                             self.int8)
                 for qtype, weights in zip(self.gate_up_types, self._gate_up)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def project_down(self, hidden: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        return self.kernels.grouped_matmul(hidden, [self._down[e] for e in experts], counts, self.down_type,
                                           self.intermediate_size, self.int8)


class GGUFEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the looked-up rows (the table may be shared with a tied head)."""

    def __init__(self, qtype: int, weight: torch.Tensor, dim: int, dtype: torch.dtype, kernels: TorchGGUF) -> None:
        super().__init__()
        self.qtype, self.dim, self.dtype, self.kernels = qtype, dim, dtype, kernels
        self.register_buffer("qweight", weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, input_ids.reshape(-1))
        table = self.kernels.dequantize_rows(rows, self.qtype, self.dim)
        return table.to(self.dtype).reshape(*input_ids.shape, self.dim)
