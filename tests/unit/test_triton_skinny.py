"""The decode matmul of few rows (kernels/triton_skinny.py) through Triton's interpreter against
F.linear, and how start-up swaps it in (skinny_linears.py) given the timings, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.kernels import skinny_linears
from crane_mp.worker.kernels.skinny_linears import SkinnyLinear, tune_skinny_linears
from tests.triton_interpreter import run_interpreted

_CHECK = """
import torch
import torch.nn.functional as F
from crane_mp.worker.kernels import triton_skinny as kernels

gen = torch.Generator().manual_seed(0)
checked = 0
for dtype in (torch.bfloat16, torch.float16):
    for out_features, in_features in ((64, 1024), (40, 300)):  # tiles divide the shape; they do not
        weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
        bias = torch.randn(out_features, generator=gen).to(dtype)
        for rows in (1, 3, 16):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            for config in kernels.candidates_for(rows):
                for b in (None, bias):
                    got = kernels.skinny_linear(x, weight, b, config)
                    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
                    assert got.shape == (rows, out_features) and got.dtype == dtype
                    # float32 sums of exact products, one rounding to the 16-bit output (the
                    # interpreter truncates: up to one step of the output dtype).
                    step = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
                    torch.testing.assert_close(got.float(), want, rtol=2 * step, atol=1e-3)
                    checked += 1
print(checked)
"""


def test_skinny_matmul_equals_f_linear_under_the_interpreter():
    pytest.importorskip("triton")
    assert int(run_interpreted(_CHECK)) > 50


class _FakeKernels:
    """What tuning uses of the kernels module (timings are stubbed): configs named by strings, a matmul
    that records its calls."""

    MAX_ROWS = 16

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def skinny_linear(self, x, weight, bias, config):
        self.calls.append((x.shape[0], config))
        return F.linear(x, weight, bias)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(nn.Linear(8, 12, dtype=torch.bfloat16) for _ in range(3))
        self.head = nn.Linear(8, 32, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight
        self.exact = nn.Linear(8, 8)  # float32: never swapped


def test_tuning_swaps_in_the_kernel_where_it_won_and_keeps_parameters_and_ties(monkeypatch):
    # Triton wins one row ("wide", 4 % faster) and two rows ("narrow"); at 4 rows it is within the
    # margin and cuBLAS stays; the head's shape never wins.
    def timings(kernels, weights, rows):
        if weights[0][0].shape[0] == 32:
            return {None: 1.0, "narrow": 1.5, "wide": 1.2}
        return {1: {None: 1.0, "narrow": 0.99, "wide": 0.96}, 2: {None: 1.0, "narrow": 0.5, "wide": 0.9},
                }.get(rows, {None: 1.0, "narrow": 0.98, "wide": 1.1})

    monkeypatch.setattr(skinny_linears, "time_candidates", timings)
    model = _Model()
    weights = [layer.weight for layer in model.layers]
    kernels = _FakeKernels()
    lines = tune_skinny_linears(model, kernels, max_rows=4)

    assert all(isinstance(layer, SkinnyLinear) for layer in model.layers)
    assert type(model.head) is nn.Linear and type(model.exact) is nn.Linear
    assert model.layers[0].configs == {1: "wide", 2: "narrow"}
    assert [layer.weight for layer in model.layers] == weights  # the same Parameters, not copies
    assert model.head.weight is model.embed.weight
    assert len(lines) == 2 and "12x8 x3: 1: triton" in "\n".join(lines)

    x = torch.randn(5, 8, dtype=torch.bfloat16)
    for rows, config in ((1, "wide"), (2, "narrow")):
        out = model.layers[1](x[:rows])
        assert kernels.calls[-1] == (rows, config)
        torch.testing.assert_close(out, F.linear(x[:rows], weights[1], model.layers[1].bias))
    calls = len(kernels.calls)
    model.layers[1](x[:4])  # cuBLAS's bucket
    model.layers[1](x)  # past every bucket: cuBLAS
    assert len(kernels.calls) == calls
    batched = model.layers[2](x[:2].view(1, 2, 8))  # leading dimensions are rows too
    assert batched.shape == (1, 2, 12) and kernels.calls[-1] == (2, "narrow")


def test_tuning_without_a_16_bit_linear_changes_nothing(monkeypatch):
    monkeypatch.setattr(skinny_linears, "time_candidates", lambda *a: pytest.fail("nothing to time"))
    model = nn.Sequential(nn.Linear(4, 4))
    assert tune_skinny_linears(model, _FakeKernels(), max_rows=8) == []
    assert type(model[0]) is nn.Linear
