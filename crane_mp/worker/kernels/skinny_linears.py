"""Decode-step linear layers on CUDA: for each weight shape and row count up to MAX_ROWS, start-up times
cuBLAS against the Triton matrix-vector kernels (kernels/triton_skinny.py) on the model's own weights
and keeps the faster; larger steps (prefill, big batches) always take cuBLAS.

The timing runs each candidate over every layer's weight of the shape in turn, as a decode step reads
them: one weight alone would sit in the GPU's L2 cache and time a bandwidth the step never sees.

A projection whose layer marks its input's op (`prologue` on the nn.Linear: "rms" for the RMSNorm and
residual add before qkv and gate/up, "silu_mul" before down) is timed with that op: the separate
kernel then cuBLAS or the plain Triton kernel, against the Triton kernel that computes the input as
it reads it; where that wins, the layer calls `after_norm` / `after_silu_mul` and one launch does both.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("crane_mp.worker")

ROW_BUCKETS = (1, 2, 4, 8, 16)
_REPEATS = 3
_MARGIN = 0.97  # a Triton kernel must beat cuBLAS by 3 %, more than the timing's noise


class SkinnyLinear(nn.Linear):
    """An nn.Linear (same parameters, shared with a tied embedding) whose few-row calls take the
    Triton config chosen for their row bucket."""

    def __init__(self, linear: nn.Linear, configs: dict, kernels, fused: frozenset = frozenset()) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.configs = configs  # row bucket -> SkinnyConfig; buckets cuBLAS won are absent
        self.fused = fused  # the buckets whose calls compute the input too (after_norm, after_silu_mul)
        self.kernels = kernels
        self.prologue = getattr(linear, "prologue", None)

    def _config(self, rows: int):
        return self.configs.get(_bucket(rows)) if rows else None

    def _prologue_config(self, x: torch.Tensor, prologue: str):
        """The config of a fused call on x, or None: another prologue, or a bucket where the separate
        kernel then cuBLAS or the plain Triton kernel was faster."""
        if self.prologue != prologue or x.dim() != 2 or not x.is_contiguous() or _bucket(x.shape[0]) not in self.fused:
            return None
        return self._config(x.shape[0])

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                   norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(norm(x + residual)), x + residual) in one kernel, the residual optional; None where this
        row count takes cuBLAS (the caller runs the norm on its own)."""
        config = self._prologue_config(x, "rms")
        if config is None or (residual is not None and not residual.is_contiguous()):
            return None
        return self.kernels.skinny_linear(x, self.weight, self.bias, config, norm=(norm.weight, norm.eps),
                                          residual=residual)

    def after_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(SiLU(gate) * up) of a [rows, 2 * in_features] gate_up in one kernel; None where this row
        count takes cuBLAS."""
        config = self._prologue_config(gate_up, "silu_mul")
        if config is None:
            return None
        return self.kernels.skinny_linear(gate_up, self.weight, self.bias, config, silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() else 0
        config = self._config(rows)
        if config is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        out = self.kernels.skinny_linear(flat, self.weight, self.bias, config)
        return out.view(*x.shape[:-1], self.out_features)


def _bucket(rows: int) -> int | None:
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return None


def _seconds_per_call(device: torch.device, run: Callable[[torch.Tensor, torch.Tensor | None], object],
                      weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> float:
    """GPU time per call, the calls replayed from a CUDA graph as decode steps run them: launched
    from Python one by one, a 20 us kernel times the host's launch path instead."""
    for weight, bias in weights[:2]:  # compile, and load the module
        run(weight, bias)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight, bias in weights:
            run(weight, bias)
    times = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return statistics.median(times)


def time_candidates(kernels, weights: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int,
                    prologue: str | None = None) -> dict:
    """Seconds per call of cuBLAS (key None) and of each Triton config that fits `rows`, each with the
    op that computes the projection's input (`prologue`): a kernel of its own before cuBLAS."""
    weight = weights[0][0]
    width = weight.shape[1] * (2 if prologue == "silu_mul" else 1)
    x = torch.randn(rows, width, dtype=weight.dtype, device=weight.device)
    fused: dict = {}
    if prologue == "rms":
        residual = torch.randn_like(x)
        norm = (torch.ones(width, dtype=weight.dtype, device=weight.device), 1e-6)
        fused = {"norm": norm, "residual": residual}
    elif prologue == "silu_mul":
        fused = {"silu_mul": True}
    results = {None: _seconds_per_call(
        weight.device, lambda w, b: F.linear(kernels.unfused_input(x, **fused) if fused else x, w, b), weights)}
    for config in kernels.candidates_for(rows):
        results[config] = _seconds_per_call(
            weight.device, lambda w, b, c=config: kernels.skinny_linear(x, w, b, c, **fused), weights)
    return results


def _shape_groups(model: nn.Module) -> dict[tuple, list[tuple[str, nn.Linear]]]:
    groups: dict[tuple, list[tuple[str, nn.Linear]]] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16) \
                and module.weight.is_contiguous():
            key = (tuple(module.weight.shape), module.weight.dtype, module.bias is not None,
                   getattr(module, "prologue", None))
            groups.setdefault(key, []).append((name, module))
    return groups


def tune_skinny_linears(model: nn.Module, kernels, max_rows: int) -> list[str]:
    """Swap each 16-bit nn.Linear whose shape the Triton kernels serve faster at some row count up to
    `max_rows` for a SkinnyLinear; returns one line per shape saying what won."""
    buckets = [b for b in ROW_BUCKETS if b <= max(1, min(max_rows, kernels.MAX_ROWS))]
    lines = []
    with torch.inference_mode():
        for (shape, _, _, prologue), modules in _shape_groups(model).items():
            weights = [(m.weight, m.bias) for _, m in modules]
            configs, fused, picks = {}, set(), []
            for rows in buckets:
                op = prologue if rows <= kernels.PROLOGUE_ROWS else None
                config, kind, line = _choose(kernels, weights, rows, op)
                if config is not None:
                    configs[rows] = config
                if kind == "fused":
                    fused.add(rows)
                picks.append(f"{rows}: {line}")
            after = f" after {prologue}" if prologue else ""
            lines.append(f"{shape[0]}x{shape[1]}{after} x{len(modules)}: " + ", ".join(picks))
            if configs:
                for name, module in modules:
                    _replace(model, name, SkinnyLinear(module, configs, kernels, frozenset(fused)))
    return lines


def _choose(kernels, weights: list, rows: int, prologue: str | None) -> tuple[object, str, str]:
    """(Triton config or None for cuBLAS, "cublas" / "triton" / "fused", a line saying what won). With a
    prologue, three ways are timed: the separate kernel then cuBLAS, the separate kernel then the plain
    Triton kernel (the separate kernel's time taken from the first), the fused Triton kernel."""
    plain = time_candidates(kernels, weights, rows)
    options = {(c, "triton"): t for c, t in plain.items() if c is not None}
    cublas = plain[None]
    if prologue is not None:
        with_op = time_candidates(kernels, weights, rows, prologue)
        op = max(0.0, with_op[None] - cublas)
        options = {key: t + op for key, t in options.items()}
        options.update({(c, "fused"): t for c, t in with_op.items() if c is not None})
        cublas = with_op[None]
    best = min(options, key=options.get, default=None)
    if best is None or options[best] >= _MARGIN * cublas:
        return None, "cublas", f"cublas {1e6 * cublas:.1f} us"
    return best[0], best[1], f"{best[1]} {1e6 * options[best]:.1f} us (cublas {1e6 * cublas:.1f})"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
