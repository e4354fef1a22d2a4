"""The decode matmul of few rows (kernels/triton_skinny.py) through Triton's interpreter against
F.linear, and how start-up swaps it in (skinny_linears.py) given the timings, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.worker.kernels import skinny_linears
from crane_mp.worker.kernels.skinny_linears import SkinnyLinear, tune_skinny_linears
from tests.triton_interpreter import run_interpreted_together

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


_PROLOGUE_CHECK = """
import torch
import torch.nn.functional as F
from crane_mp.worker.kernels import triton_skinny as kernels

gen = torch.Generator().manual_seed(1)
checked = 0
dtype = torch.bfloat16
for out_features, in_features in ((64, 1024), (40, 300)):
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(in_features, generator=gen)).to(dtype)
    for rows in (1,):
        x = (3 * torch.randn(rows, in_features, generator=gen)).to(dtype)
        residual = torch.randn(rows, in_features, generator=gen).to(dtype)
        gate_up = torch.randn(rows, 2 * in_features, generator=gen).to(dtype)
        hidden = (F.silu(gate_up[:, :in_features].float()) * gate_up[:, in_features:].float()).to(dtype)
        summed = (x.float() + residual.float()).to(dtype)
        for config in kernels.candidates_for(rows)[:2]:
            for b in (None, bias):
                fb = None if b is None else b.float()
                for res, rows_in in ((None, x), (residual, summed)):
                    before = residual.clone()
                    got, normalised = kernels.skinny_linear(x, weight, b, config, norm=(norm_weight, 1e-6),
                                                            residual=res)
                    assert torch.equal(residual, before)  # the sum goes to a tensor of its own
                    # the interpreter truncates to bf16 (the GPU rounds to nearest): up to one step
                    torch.testing.assert_close(normalised.float(), rows_in.float(), rtol=2 ** -7, atol=0)
                    normed = F.rms_norm(rows_in.float(), (in_features,), norm_weight.float(), 1e-6)
                    want = F.linear(normed, weight.float(), fb)
                    # several rows take bf16 tensor-core products: the input is rounded once there
                    torch.testing.assert_close(got.float(), want, rtol=2 ** -5, atol=0.05 * want.abs().max().item())
                    checked += 1
                got = kernels.skinny_linear(gate_up, weight, b, config, silu_mul=True)
                want = F.linear(hidden.float(), weight.float(), fb)
                torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=1e-2 * want.abs().max().item())
                checked += 1
print(checked)
"""


_LAYERS_CHECK = """
import torch
from transformers import Qwen3Config
from crane_mp.models.config import model_config_from_hf
from crane_mp.worker.kernels import triton_skinny
from crane_mp.worker.kernels.skinny_linears import ROW_BUCKETS, SkinnyLinear, _replace
from crane_mp.worker.models.build import build_meta_model, materialize
from tests.model_helpers import CPU, prefill_logits

config = model_config_from_hf(Qwen3Config(hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                          vocab_size=300, max_position_embeddings=64))
model = build_meta_model(config, torch.bfloat16, CPU)
materialize(model, torch.device("cpu"))
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, param in model.named_parameters():
        param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.05 * torch.randn(param.shape, generator=gen))
for attn in model.attention_layers():
    attn.finalize_weights()
prompts = [[42], [7]]  # one row: a decode step of one sequence
plain = [prefill_logits(model, p) for p in prompts]
calls = []
def counted(*args, **kwargs):
    calls.append(tuple(k for k in ("norm", "silu_mul") if kwargs.get(k)))
    return triton_skinny.skinny_linear(*args, **kwargs)
class Kernels:
    PROLOGUE_ROWS = triton_skinny.PROLOGUE_ROWS
    skinny_linear = staticmethod(counted)
for name, module in list(model.named_modules()):
    if type(module) is torch.nn.Linear:
        _replace(model, name, SkinnyLinear(module, {b: triton_skinny.CANDIDATES[1] for b in ROW_BUCKETS}, Kernels,
                                           fused=frozenset(ROW_BUCKETS)))
for prompt, want in zip(prompts, plain):
    calls.clear()
    got = prefill_logits(model, prompt)
    # each layer: qkv after its input norm, gate/up after its post-attention norm, down after SiLU*mul
    assert calls.count(("norm",)) == 2 * 3 and calls.count(("silu_mul",)) == 3, calls
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.03 * scale, ((got - want).abs().max(), scale)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
print("layers ok")
"""


def test_the_skinny_matmul_and_its_prologues_equal_the_unfused_ops_also_inside_a_decoder_under_the_interpreter():
    """The matmul against F.linear; RMSNorm (with and without the residual add, whose sum comes back as
    stored) and SiLU*mul computed as the projection reads its input, against the unfused ops then
    F.linear; a bf16 Qwen3 whose projections all take the Triton kernel: every layer hands its norms (the
    first without a residual) and SiLU*mul to the projections after them, and the logits stay those of the
    unfused layers up to bf16 roundings. The three checks at once, each in a process of its own."""
    pytest.importorskip("triton")
    matmuls, prologues, layers = run_interpreted_together(_CHECK, _PROLOGUE_CHECK, _LAYERS_CHECK)
    assert int(matmuls) > 50
    assert int(prologues) == 2 * 1 * 2 * 2 * 3
    assert "layers ok" in layers


class _FakeKernels:
    """What tuning uses of the kernels module (timings are stubbed): configs named by strings, a matmul
    that records its calls."""

    MAX_ROWS = 16
    PROLOGUE_ROWS = 1

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def skinny_linear(self, x, weight, bias, config, norm=None, residual=None, silu_mul=False):
        if norm is not None:
            self.calls.append((x.shape[0], config, "norm"))
            summed = x if residual is None else x + residual
            return F.linear(F.rms_norm(summed, (x.shape[-1],), norm[0], norm[1]), weight, bias), summed
        if silu_mul:
            self.calls.append((x.shape[0], config, "silu_mul"))
            gate, up = x.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, weight, bias)
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
    def timings(kernels, weights, rows, prologue=None):
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


def test_projections_after_a_norm_or_silu_mul_are_timed_with_it_and_take_it_in_where_that_won(monkeypatch):
    """Start-up times a marked projection three ways at one row: the separate kernel then cuBLAS, the
    separate kernel then the plain Triton kernel, the fused kernel; unmarked ones of the same shape apart.
    Where the fused kernel won, the layer's call hands it the norm or gate_up; elsewhere it answers None
    and the layer runs the op itself (before the plain Triton kernel where that won)."""
    timed = []

    def timings(kernels, weights, rows, prologue=None):
        timed.append((rows, prologue))
        if prologue is None:  # the plain kernels: Triton wins for every shape
            return {None: 1.0, "config": 0.8}
        # the op costs 0.3 (1.3 - 1.0); fused: 0.9 after a norm (beats 0.8 + 0.3), 1.2 after SiLU*mul (loses)
        return {None: 1.3, "config": 0.9 if prologue == "rms" else 1.2}

    monkeypatch.setattr(skinny_linears, "time_candidates", timings)
    model = nn.ModuleDict({"qkv": nn.Linear(8, 12, bias=False, dtype=torch.bfloat16),
                           "other": nn.Linear(8, 12, bias=False, dtype=torch.bfloat16),
                           "down": nn.Linear(8, 12, bias=False, dtype=torch.bfloat16)})
    model["qkv"].prologue, model["down"].prologue = "rms", "silu_mul"
    kernels = _FakeKernels()
    lines = tune_skinny_linears(model, kernels, max_rows=2)
    assert sorted(timed, key=str) == sorted([(1, None)] * 3 + [(2, None)] * 3 + [(1, "rms"), (1, "silu_mul")], key=str)
    assert model["qkv"].fused == {1} and model["down"].fused == set() and model["other"].fused == set()
    assert all(m.configs == {1: "config", 2: "config"} for m in model.values())
    assert "12x8 after rms x1: 1: fused 900000.0 us (cublas 1300000.0)" in "\n".join(lines)  # timings in s
    norm = nn.RMSNorm(8, eps=1e-6, dtype=torch.bfloat16)
    x, residual = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16)
    out, summed = model["qkv"].after_norm(x[:1], residual[:1], norm)
    assert kernels.calls[-1] == (1, "config", "norm") and torch.equal(summed, x[:1] + residual[:1])
    assert model["qkv"].after_norm(x, residual, norm) is None  # two rows: the prologues serve one
    assert model["down"].after_silu_mul(torch.randn(1, 16, dtype=torch.bfloat16)) is None  # plain Triton won
    assert model["qkv"].after_silu_mul(torch.randn(1, 16, dtype=torch.bfloat16)) is None  # not its layer's op


def test_tuning_without_a_16_bit_linear_changes_nothing(monkeypatch):
    monkeypatch.setattr(skinny_linears, "time_candidates", lambda *a: pytest.fail("nothing to time"))
    model = nn.Sequential(nn.Linear(4, 4))
    assert tune_skinny_linears(model, _FakeKernels(), max_rows=8) == []
    assert type(model[0]) is nn.Linear
