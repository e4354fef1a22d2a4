"""Pre-packed bf16 linear weights for the CPU's matrix units.

A plain bf16 weight is reordered into a blocked layout on every call; packing it once at load time
is faster with identical math. Three backends:

- our AMX kernel (worker/kernels/amx_linear.cpp) when the CPU has AMX and the native kernels are
  built: ~2x oneDNN on decode-sized GEMMs; results equal up to float summation order;
- our AVX512-BF16 kernel (worker/kernels/bf16_linear.cpp) on CPUs with AVX512-BF16 but no AMX (Zen 4
  and 5): 1.4-1.7x oneDNN's packed linear at up to 8 rows (decode at the memory bus's rate),
  1.2x at 16, 0.99-1.05x at 32 to 256; results equal up to float summation order;
- oneDNN's packed linear otherwise (or for shapes ours cannot block): ~20% faster than a plain weight
  at 32 rows, identical results;
- in a float32 model on a CPU without bf16 math (AVX2, AVX-512 without BF16), the linear weights that
  are bf16 values (a bf16 checkpoint's, widened at load) go back to bf16 for our widened kernel
  (worker/kernels/widened_linear.cpp): half the memory and half the bytes a decode step reads, the
  same float32 math up to summation order; other float32 weights stay plain nn.Linear.

With oneDNN, prefill-sized calls take a float32 copy of the weight besides it, when memory allows.

The packed tensor replaces the plain weight (no second copy). An LM head tied to the embedding is
packed in place for our kernels (AMX or AVX512-BF16), whose layouts the embedding lookup reads rows
back from; with oneDNN the lookup needs the plain layout, so a tied head is packed as a copy where
memory allows (`spare`: oneDNN multiplies a plain bf16 head at less than half the speed at one row)
and stays plain otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.kernels.cpu_isa import amx_gemm, bf16_linear, widened_linear

# From this many rows on, a float32 copy of the weights multiplies faster than oneDNN's bf16 kernels
# on CPUs without AMX (with AVX512-BF16, bf16 has the same peak FLOPs and pays for conversions):
# 1.2x at 64 rows, 1.4x at 128-2048 rows, the same at 32 (benchmarks/RESULTS.md).
WIDE_ROWS = 64


def _amx_shape_ok(linear: nn.Linear) -> bool:
    return linear.in_features % 32 == 0 and linear.out_features % 32 == 0


def _bf16_ours(linear: nn.Linear) -> bool:
    """Our AVX512-BF16 kernel runs here and takes this bf16 weight (its blocks: 16 outputs by two inputs)."""
    return (bf16_linear() and linear.weight.dtype == torch.bfloat16 and linear.in_features % 2 == 0
            and linear.out_features % 16 == 0)


def _widened(linear: nn.Linear) -> bool:
    """Our widened kernel takes this float32 weight: its blocks fit (8 outputs by two inputs) and every
    value is a bf16 one, so nothing is rounded."""
    weight = linear.weight
    return (widened_linear() and weight.dtype == torch.float32 and linear.in_features % 2 == 0
            and linear.out_features % 8 == 0 and torch.equal(weight.bfloat16().float(), weight))


def _interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [a0..a(n-1), b0..b(n-1)] -> 16-row blocks [a0-15, b0-15, a16-31, b16-31, ...]."""
    half = t.shape[0] // 2
    return t.reshape(2, half // 16, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


class PackedLinear(nn.Module):
    """With `gate_up_silu` (a gated MLP's fused gate/up projection with SiLU) and AMX, the module
    returns silu(gate) * up directly: the activation runs in the GEMM's epilogue (`silu_mul`).
    With `wide_float32` (oneDNN only) a float32 copy of the weight serves calls of WIDE_ROWS rows or
    more: prefill chunks. With `widened` (a float32 weight of bf16 values, see _widened) the widened
    kernel takes it, kept as bf16."""

    def __init__(self, linear: nn.Linear, gate_up_silu: bool = False, wide_float32: bool = False,
                 widened: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.widened = widened  # float32 math over bf16 weights (_widened)
        self.amx = not self.widened and amx_gemm() and _amx_shape_ok(linear)
        self.ours = not self.amx and _bf16_ours(linear)  # our AVX512-BF16 kernel
        self.silu_mul = self.amx and gate_up_silu
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if self.silu_mul:
            weight = _interleave_halves(weight)
            bias = None if bias is None else _interleave_halves(bias)
        if self.widened:
            packed = torch.ops.crane_mp.widened_pack_weight(weight.bfloat16())
            bias = None if bias is None else bias.float()
        elif self.amx:
            packed = torch.ops.crane_mp.amx_pack_weight(weight)
        elif self.ours:
            packed = torch.ops.crane_mp.bf16_pack_weight(weight)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("bias", bias)
        # Not beside ours: on Zen 4 the float32 GEMM runs at half the bf16 rate (benchmarks/cpu_gemm.py).
        wide = wide_float32 and not self.amx and not self.ours and not self.widened
        self.register_buffer("wide_weight", torch.ops.mkldnn._reorder_linear_weight(weight.float(), None) if wide else None)
        self.register_buffer("wide_bias", bias.float() if wide and bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul:
            return torch.ops.crane_mp.amx_linear_silu_mul(x, self.packed_weight, self.bias)
        if self.amx:
            return torch.ops.crane_mp.amx_linear(x, self.packed_weight, self.bias)
        if self.widened:  # rows of any leading shape, as nn.Linear takes them
            out = torch.ops.crane_mp.widened_linear(x.reshape(-1, self.in_features), self.packed_weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.wide_weight is not None and x.shape[0] >= WIDE_ROWS:
            # bf16 x bf16 products are exact in float32: this is the bf16 GEMM up to summation order.
            return in_row_buckets(x.float(), self._wide).to(x.dtype)
        if self.ours:
            return torch.ops.crane_mp.bf16_packed_linear(x, self.packed_weight, self.bias)
        return in_row_buckets(x, self._packed)

    def _wide(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.wide_weight, self.wide_bias, "none", [], "")

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


# oneDNN compiles a kernel for every row count it is called with and keeps it (in ideep's cache and
# oneDNN's own, 1,024 entries apiece by default, ~1.4 MB per row count and weight shape): a server's
# ever-changing batch and chunk sizes grow a worker by gigabytes. Calls are made with few row counts
# instead: up to 8 rows as they are, then padded to a multiple of 8 (to 64) or 16 (to 256), and longer
# inputs in slabs of 256 rows. With the caches capped (heap.py) and every bucket compiled at start-up
# (warm_row_buckets), the kernels kept stay what the memory plan counted.
_SLAB_ROWS = 256


def bucket_rows(rows: int) -> int:
    """The row count a call of `rows` rows (at most _SLAB_ROWS) is padded to."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 16
    return -(-rows // step) * step


def row_buckets(max_rows: int = _SLAB_ROWS) -> list[int]:
    """Every row count oneDNN is called with for calls of up to `max_rows` rows."""
    return sorted({bucket_rows(rows) for rows in range(1, min(max_rows, _SLAB_ROWS) + 1)})


def in_row_buckets(x: torch.Tensor, linear) -> torch.Tensor:
    """linear(x) for x [rows, in], called only with the row counts of bucket_rows (zero rows padded
    in, their outputs dropped)."""
    rows = x.shape[0]
    if rows > _SLAB_ROWS:
        return torch.cat([in_row_buckets(x[start : start + _SLAB_ROWS], linear)
                          for start in range(0, rows, _SLAB_ROWS)])
    padded = bucket_rows(rows)
    if padded == rows:
        return linear(x)
    return linear(torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]))[:rows]


def warm_row_buckets(model: nn.Module, max_rows: int) -> tuple[int, int]:
    """Have oneDNN compile its kernel for every row count the worker will call it with (up to
    `max_rows`), once per weight shape: its caches key on shapes, so layers of a shape share them.
    Serving then compiles nothing and keeps no more than this. Returns (weight shapes, calls)."""
    buckets = row_buckets(max_rows)
    shapes = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and not module.amx and not module.ours and not module.widened:
            shapes.setdefault((module.in_features, module.out_features, module.wide_weight is not None), module)
    with torch.inference_mode():
        for module in shapes.values():
            for rows in buckets:
                module(torch.zeros(rows, module.in_features, dtype=module.packed_weight.dtype))
    return len(shapes), len(shapes) * len(buckets)


class PackedEmbedding(nn.Module):
    """Embedding lookup from the packed weight of the tied LM head (AMX's layout, ours, or the widened
    kernel's, whose rows come back as float32)."""

    def __init__(self, packed: PackedLinear) -> None:
        super().__init__()
        self.register_buffer("packed_weight", packed.packed_weight)
        ops = torch.ops.crane_mp
        self.lookup = (ops.amx_embedding if packed.amx else ops.widened_embedding if packed.widened
                       else ops.bf16_packed_embedding)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids, self.packed_weight)


def spare_copies_fit(model: nn.Module, host_bytes: int) -> bool:
    """The extra copies oneDNN serves faster from (a float32 copy of every linear weight, a packed copy
    of a tied head) are worth their memory if they take at most an eighth of host RAM: small and
    mid-size models; never an 8B model's 32 GB. Never with AMX, which needs neither."""
    if amx_gemm():
        return False
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return sum(m.weight.numel() * (4 + m.weight.element_size()) for m in linears) <= host_bytes // 8


def pack_linear_weights(model: nn.Module, spare: bool = False, fuse_activation: bool = True) -> int:
    """Swap every nn.Linear for a PackedLinear (a tied LM head in place for our kernels, as a copy with
    `spare`, see above); returns how many were packed. `spare` also adds the float32 copies.
    `fuse_activation` off keeps gate_up's raw output (a LoRA adapter adds to it before SiLU)."""
    embeddings = {
        id(module.weight): name for name, module in model.named_modules() if isinstance(module, nn.Embedding)
    }
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        widened = _widened(module)
        if module.weight.dtype == torch.float32 and not widened:
            continue  # a float32 layer keeps torch's linear
        tied_embedding = embeddings.get(id(module.weight))
        ours = widened or amx_gemm() and _amx_shape_ok(module) or not amx_gemm() and _bf16_ours(module)
        in_place = tied_embedding is not None and ours
        if tied_embedding is not None and not in_place and not spare:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        silu = fuse_activation and child == "gate_up_proj" and getattr(parent, "act", None) is F.silu
        packed = PackedLinear(module, gate_up_silu=silu, wide_float32=spare, widened=widened)
        setattr(parent, child, packed)
        if in_place:
            _replace(model, tied_embedding, PackedEmbedding(packed))
        count += 1
    return count


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
