"""The 8-bit-activation GGUF matmul against a numpy reference of the same scheme: activations quantized
as llama.cpp does (blocks of 256 for the K-quants, 32 otherwise; d = amax / 127, values rounded half to
even), then dequantized weights times dequantized activations in float64. The integer dot products are
exact, so the kernel must equal it up to float rounding, for every type, odd shapes and 1 to 64 rows,
at the tier this process runs (CI runs the suite again under CRANE_MP_ISA=avx2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.worker.kernels.cpu_isa import kernel_isa
from tests.unit.test_gguf_kernels import quantized, reference

pytestmark = pytest.mark.skipif(kernel_isa() is None, reason="native kernels disabled or not built")

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def activation_block(qtype: int) -> int:
    return 256 if qtype in K_QUANTS else 32


def quantize_reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [M, K] -> (int8 values [M, K], float32 scales [M, K / block], int16 sums of 16 [M, K / 16])."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // block, block)
    amax = np.abs(blocks).max(axis=-1)
    scales = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    values = np.rint(blocks * inverse[..., None]).astype(np.int8).reshape(rows, cols)
    sums = values.reshape(rows, cols // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return values, scales, sums


def activations(rows: int, cols: int, seed: int) -> np.ndarray:
    """Activations with outlier channels and an all-zero row, as hidden states have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 4.0, (1, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, 3)] *= 30
    if rows > 2:
        x[1] = 0
    return x


def cols_for(qtype: int) -> list[int]:
    return [256, 768] if qtype in K_QUANTS else [96, 544]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_activation_quantization_equals_reference(qtype):
    block = activation_block(qtype)
    for cols in cols_for(qtype):
        x = activations(9, cols, seed=cols)
        q, d, sums = torch.ops.crane_mp.gguf_quantize_activations(torch.from_numpy(x), qtype)
        want_q, want_d, want_sums = quantize_reference(x, block)
        np.testing.assert_array_equal(q.numpy(), want_q)
        np.testing.assert_array_equal(d.numpy(), want_d)
        np.testing.assert_array_equal(sums.numpy(), want_sums)
        assert np.abs(want_q.astype(np.int32)).max() == 127


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_int8_matmul_equals_integer_reference(qtype):
    block = activation_block(qtype)
    for rows, cols in [(37, cols_for(qtype)[0]), (301, cols_for(qtype)[1])]:
        data = quantized(qtype, rows, cols, seed=rows)
        weight = torch.from_numpy(data.copy())
        dense = reference(data, qtype, cols).double().numpy()
        for batch in (1, 2, 3, 4, 5, 7, 17, 64):
            x = activations(batch, cols, seed=batch)
            values, scales, _ = quantize_reference(x, block)
            x_q = values.astype(np.float64) * np.repeat(scales.astype(np.float64), block, axis=1)
            want = x_q @ dense.T
            got = torch.ops.crane_mp.gguf_linear_int8(torch.from_numpy(x), weight, qtype, cols)
            assert got.shape == (batch, rows) and got.dtype == torch.float32
            # Float rounding of the block scales and sums: relative to the products' magnitudes.
            magnitude = np.abs(x_q) @ np.abs(dense).T
            err = np.abs(got.double().numpy() - want)
            assert (err <= 2e-6 * magnitude + 1e-30).all(), f"{T(qtype).name} batch {batch} {rows}x{cols}: {err.max()}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_int8_matmul_is_close_to_the_float_matmul(qtype):
    """What 8-bit activations cost: a small error against float activations, not a different answer."""
    cols = cols_for(qtype)[1]
    data = quantized(qtype, 64, cols, seed=7)
    weight = torch.from_numpy(data.copy())
    x = torch.from_numpy(activations(6, cols, seed=11))
    exact = x.double() @ reference(data, qtype, cols).double().T
    got = torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, cols).double()
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.05, relative  # outlier channels coarsen 256-wide blocks most


def test_bf16_activations_return_bf16():
    data = quantized(T.Q4_K, 40, 256)
    x = torch.from_numpy(activations(3, 256, seed=2))
    got = torch.ops.crane_mp.gguf_linear_int8(x.bfloat16(), torch.from_numpy(data.copy()), T.Q4_K, 256)
    want = torch.ops.crane_mp.gguf_linear_int8(x.bfloat16().float(), torch.from_numpy(data.copy()), T.Q4_K, 256)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16())


def test_many_tiles_under_inference_mode():
    """Enough weight rows for several tiles per thread, prefill-sized batches, inference tensors."""
    data = quantized(T.Q4_K, 2048, 1024, seed=5)
    x = activations(70, 1024, seed=3)
    values, scales, _ = quantize_reference(x, 256)
    want = (values.astype(np.float64) * np.repeat(scales, 256, axis=1)) @ reference(data, T.Q4_K, 1024).double().numpy().T
    with torch.inference_mode():
        got = torch.ops.crane_mp.gguf_linear_int8(torch.from_numpy(x), torch.from_numpy(data.copy()), T.Q4_K, 1024)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bad_inputs_are_errors_not_crashes():
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.crane_mp.gguf_linear_int8(torch.randn(1, 256), torch.zeros(4, 100, dtype=torch.uint8), T.Q4_K, 256)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.crane_mp.gguf_linear_int8(torch.randn(2, 128), torch.zeros(4, 144, dtype=torch.uint8), T.Q4_K, 256)
    with pytest.raises(RuntimeError, match="no 8-bit activation scheme"):
        torch.ops.crane_mp.gguf_linear_int8(torch.randn(1, 32), torch.zeros(4, 64, dtype=torch.uint8), T.F16, 32)


def _signed_q6_k_scales(weight: torch.Tensor) -> None:
    """Signed Q6_K scales, as llama.cpp's quantizer writes them, down to -128."""
    scales = weight.view(-1, 210)[:, 192:208].view(torch.int8)
    scales[:, ::3] = -scales[:, ::3]
    scales[::7, 5] = -128


@pytest.mark.parametrize("qtype, rows, cols", [(T.Q4_K, 40, 256), (T.Q4_K, 304, 768), (T.Q6_K, 40, 256),
                                               (T.Q6_K, 304, 768), (T.Q8_0, 40, 32), (T.Q8_0, 304, 800)])
def test_rows_repacked_by_eight_give_the_row_kernel_results(qtype, rows, cols):
    """The repacked layout changes the order of the integer sums, not their value: same outputs up to
    float rounding, for every batch size (4 rows a call and their tails; 400 rows of 768 columns walk
    weight tiles first, fewer walk weight groups first)."""
    from crane_mp.worker.quantized.formats import Q4_K_X8, Q6_K_X8, Q8_0_X8

    weight = torch.from_numpy(quantized(qtype, rows, cols, seed=rows).copy())
    if qtype == T.Q6_K:
        _signed_q6_k_scales(weight)
    repack, packed_type, row_bytes = {T.Q4_K: ("gguf_repack_q4_k_x8", Q4_K_X8, cols // 256 * 148),
                                      T.Q6_K: ("gguf_repack_q6_k_x8", Q6_K_X8, cols // 256 * 210),
                                      T.Q8_0: ("gguf_repack_q8_0_x8", Q8_0_X8, cols // 32 * 34)}[qtype]
    packed = getattr(torch.ops.crane_mp, repack)(weight, cols)
    assert packed.shape == (rows, row_bytes)
    assert not torch.equal(packed, weight)
    for batch in (1, 2, 3, 4, 5, 9, 17, 22, 64, 400):
        x = torch.from_numpy(activations(batch, cols, seed=batch))
        want = torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, cols)
        got = torch.ops.crane_mp.gguf_linear_int8(x, packed, packed_type, cols)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


X16 = {T.Q4_K: "gguf_repack_q4_k_x16", T.Q6_K: "gguf_repack_q6_k_x16", T.Q4_0: "gguf_repack_q4_0_x16"}


@pytest.mark.parametrize("qtype", list(X16))
def test_rows_repacked_by_sixteen_give_the_row_kernel_results(qtype):
    """The 512-bit layouts (16 rows a group, up to 8 activation rows a call; Q6_K with each value's 6
    bits together): same outputs as GGUF's rows up to float rounding, for 1-8 rows a call and their
    tails, weight groups first and tiles first, in passes of rows (520: two and a tail), Q6_K's signed scales
    down to -128."""
    from crane_mp.worker.quantized.formats import Q4_0_X16, Q4_K_X16, Q6_K_X16

    if not torch.ops.crane_mp.gguf_x16_supported(qtype):
        pytest.skip("this CPU or kernel tier lacks AVX512-VNNI (or VBMI for Q6_K)")
    for rows, cols in ((16, 256), (48, 768), (304, 1024)):
        weight = torch.from_numpy(quantized(qtype, rows, cols, seed=rows).copy())
        if qtype == T.Q6_K:
            _signed_q6_k_scales(weight)
        packed = getattr(torch.ops.crane_mp, X16[qtype])(weight, cols)
        row_bytes = {T.Q4_K: cols // 256 * 148, T.Q6_K: cols // 256 * 210, T.Q4_0: cols // 32 * 18}[qtype]
        assert packed.shape == (rows, row_bytes)
        assert not torch.equal(packed[:, :144], weight[:, :144])
        for batch in (1, 2, 5, 8, 9, 17, 64, 300, 520):
            x = torch.from_numpy(activations(batch, cols, seed=batch))
            want = torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, cols)
            got = torch.ops.crane_mp.gguf_linear_int8(x, packed, {T.Q4_K: Q4_K_X16, T.Q6_K: Q6_K_X16,
                                                                  T.Q4_0: Q4_0_X16}[qtype], cols)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", list(X16))
def test_sixteen_row_layout_follows_the_cpu(qtype):
    """Q4_K, Q6_K and Q4_0 go sixteen rows a group where their x16 kernel runs, else (or for rows in
    eights only) eight, Q4_0 as the file has them; a sixteen-row repack of rows that do not fill groups
    of 16 is an error."""
    from crane_mp.worker.quantized.formats import Q4_0_X16, Q4_K_X8, Q4_K_X16, Q6_K_X8, Q6_K_X16
    from crane_mp.worker.quantized.matmul import NativeGGUF

    x8, x16 = {T.Q4_K: (Q4_K_X8, Q4_K_X16), T.Q6_K: (Q6_K_X8, Q6_K_X16), T.Q4_0: (T.Q4_0, Q4_0_X16)}[qtype]
    native = NativeGGUF()
    sixteen = torch.from_numpy(quantized(qtype, 32, 256).copy())
    eight = torch.from_numpy(quantized(qtype, 24, 256).copy())
    expected = x16 if torch.ops.crane_mp.gguf_x16_supported(qtype) else x8
    assert native.layout(qtype, sixteen, 256, int8=True)[0] == expected
    assert native.layout(qtype, eight, 256, int8=True)[0] == x8
    with pytest.raises(RuntimeError, match="groups of 16"):
        getattr(torch.ops.crane_mp, X16[qtype])(eight, 256)
    native.x16 = set()
    assert native.layout(qtype, sixteen, 256, int8=True)[0] == x8


def test_only_whole_groups_of_eight_rows_are_repacked():
    from crane_mp.worker.quantized.formats import Q4_K_X8, Q8_0_X8
    from crane_mp.worker.quantized.matmul import NativeGGUF

    kernel_layout = NativeGGUF().layout

    odd = torch.from_numpy(quantized(T.Q4_K, 12, 256).copy())
    with pytest.raises(RuntimeError, match="groups of 8"):
        torch.ops.crane_mp.gguf_repack_q4_k_x8(odd, 256)
    assert kernel_layout(T.Q4_K, odd, 256, int8=True) == (T.Q4_K, odd)
    whole = torch.from_numpy(quantized(T.Q4_K, 24, 256).copy())
    assert kernel_layout(T.Q4_K, whole, 256, int8=False)[0] == T.Q4_K
    assert kernel_layout(T.Q4_K, whole, 256, int8=True)[0] == Q4_K_X8
    q5 = torch.from_numpy(quantized(T.Q5_K, 16, 256).copy())
    assert kernel_layout(T.Q5_K, q5, 256, int8=True)[0] == T.Q5_K
    q8 = torch.from_numpy(quantized(T.Q8_0, 16, 64).copy())
    assert kernel_layout(T.Q8_0, q8, 64, int8=True)[0] == Q8_0_X8
    with pytest.raises(RuntimeError, match="groups of 8"):
        torch.ops.crane_mp.gguf_repack_q8_0_x8(q8[:12].contiguous(), 64)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.MXFP4])
def test_grouped_experts_give_each_expert_s_own_matmul(qtype):
    """A mixture's experts in one call: run i of x's rows times weight i equals gguf_linear_int8 of that
    run alone (the same integer sums), for runs of 0 to 9 rows, on the file's rows and repacked ones."""
    from crane_mp.worker.platforms import platform_for

    cols = 512 if qtype in K_QUANTS else 96
    kernels = platform_for("cpu").gguf  # the CPU's kernels (NativeGGUF)
    laid_out = [kernels.layout(qtype, torch.from_numpy(quantized(qtype, 48, cols, seed=e).copy()), cols, True)
                for e in range(5)]
    layout_type = laid_out[0][0]
    weights = [weight for _, weight in laid_out]
    runs = [3, 0, 9, 1, 4]
    x = torch.from_numpy(activations(sum(runs), cols, seed=7))
    got = torch.ops.crane_mp.gguf_grouped_linear_int8(x, weights, runs, layout_type, cols)
    start = 0
    for weight, count in zip(weights, runs):
        want = torch.ops.crane_mp.gguf_linear_int8(x[start : start + count], weight, layout_type, cols)
        torch.testing.assert_close(got[start : start + count], want, rtol=0, atol=0)
        start += count
    assert torch.equal(kernels.grouped_matmul(x, weights, runs, layout_type, cols, int8=True), got)
    with pytest.raises(RuntimeError, match="the runs hold 17 rows, x 16"):
        torch.ops.crane_mp.gguf_grouped_linear_int8(x[:16], weights, runs, layout_type, cols)


@pytest.mark.parametrize("gate_up_type,down_type", [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0), (T.Q5_0, T.Q4_K)])
def test_one_token_s_experts_in_one_call_equal_the_experts_own_steps(gate_up_type, down_type):
    """A lone decode token through its experts in one kernel call (gguf_moe_token_int8, GGUFExperts'
    path for one token) gives what the grouped matmuls, SiLU*mul and the gates' sum give, to float
    rounding; more tokens keep the grouped path; routing counts are kept either way."""
    import numpy as np
    import torch.nn.functional as F

    from crane_mp.worker.models.moe import RoutedExperts
    from crane_mp.worker.platforms import platform_for
    from crane_mp.worker.quantized.layers import GGUFExperts

    hidden, width, count = 512, 256, 6
    kernels = platform_for("cpu").gguf

    def stack(qtype, rows, cols):
        laid = [kernels.layout(qtype, torch.from_numpy(quantized(qtype, rows, cols, seed=e).copy()), cols, True)
                for e in range(count)]
        return laid[0][0], torch.stack([weight for _, weight in laid])

    experts = GGUFExperts(hidden, width, [stack(gate_up_type, 2 * width, hidden)], stack(down_type, hidden, width),
                          kernels, True, F.silu)
    assert experts._one_call
    experts.routed = np.zeros(count, dtype=np.int64)
    x = torch.from_numpy(activations(3, hidden, seed=3))
    ids = torch.tensor([[4, 1, 5], [0, 2, 4], [3, 5, 1]])
    gates = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]])
    with torch.inference_mode():
        for token in range(3):
            row, chosen, weights = x[token : token + 1], ids[token : token + 1], gates[token : token + 1]
            one = experts(row, chosen, weights)
            steps = RoutedExperts.forward(experts, row, chosen, weights)
            torch.testing.assert_close(one, steps, rtol=1e-5, atol=1e-5 * steps.abs().max().item())
            bf16 = experts(row.bfloat16(), chosen, weights)
            assert bf16.dtype == torch.bfloat16 and bf16.shape == (1, hidden)
        batch = experts(x, ids, gates)
    assert torch.equal(batch[1:2], RoutedExperts.forward(experts, x, ids, gates)[1:2])
    # Each token counted by its three calls alone (one call, its steps, bf16) and the batch's two.
    assert experts.routed.tolist() == (5 * torch.bincount(ids.flatten(), minlength=count)).tolist()
    with pytest.raises(RuntimeError, match="expert 6 of 6"):
        torch.ops.crane_mp.gguf_moe_token_int8(x[:1], torch.tensor([6]), torch.tensor([1.0]), experts.qweight_0,
                                               experts.gate_up_types[0], experts.qweight_1, experts.down_type)


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_a_layer_s_parts_of_several_types_in_one_call_equal_each_part_s_matmul(rows):
    """q, k and v of a Q4_K_M file (Q4_K, Q6_K) and a 32-block type beside them, laid out as the server
    loads them: one call gives each part's own kernel output side by side (the same integer sums)."""
    from crane_mp.worker.platforms import platform_for

    kernels = platform_for("cpu").gguf
    cols = 512
    parts = [kernels.layout(qtype, torch.from_numpy(quantized(qtype, count, cols, seed=count).copy()), cols, True)
             for qtype, count in ((T.Q4_K, 64), (T.Q6_K, 32), (T.Q8_0, 16), (T.Q5_0, 24))]
    x = torch.from_numpy(activations(rows, cols, seed=rows))
    want = torch.cat([torch.ops.crane_mp.gguf_linear_int8(x, weight, qtype, cols) for qtype, weight in parts], dim=-1)
    got = kernels.matmul_parts(x, parts, cols, int8=True)
    assert got.shape == (rows, 64 + 32 + 16 + 24)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    one_call = torch.ops.crane_mp.gguf_linear_parts_int8(x, [w for _, w in parts], [t for t, _ in parts], cols)
    torch.testing.assert_close(one_call, want, rtol=0, atol=0)
    assert kernels.matmul_parts(x.bfloat16(), parts, cols, int8=True).dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_gate_and_up_with_silu_in_one_call_equal_the_parts_then_silu_and_mul(rows):
    """A gated MLP's gate and up in one call (gguf_gate_up_silu_int8: each thread's columns of both, SiLU
    applied before anything is written out) give bit for bit what the parts' call and silu_and_mul give,
    each product rounded to bf16 first where x is bf16; for repacked types, mixed ones, and GGUF's own rows
    with tails of fewer columns than a task takes."""
    from crane_mp.worker.platforms import platform_for

    kernels = platform_for("cpu").gguf
    for (gate_type, up_type), (width, cols) in (((T.Q4_K, T.Q4_K), (208, 512)), ((T.Q4_K, T.Q6_K), (48, 256)),
                                                ((T.Q8_0, T.Q5_0), (40, 96))):
        gate, up = (kernels.layout(qtype, torch.from_numpy(quantized(qtype, width, cols, seed=seed).copy()), cols, True)
                    for seed, qtype in enumerate((gate_type, up_type)))
        x = torch.from_numpy(activations(rows, cols, seed=rows))
        for dtype in (torch.float32, torch.bfloat16):
            want = torch.ops.crane_mp.silu_and_mul(kernels.matmul_parts(x.to(dtype), [gate, up], cols, int8=True))
            got = kernels.gate_up_silu(x.to(dtype), gate, up, cols, int8=True)
            assert got.dtype == dtype and got.shape == (rows, width)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert kernels.gate_up_silu(x, gate, up, cols, int8=False) is None  # float activations: no such call
    assert kernels.gate_up_silu(x, gate, (up[0], up[1][:8]), cols, int8=True) is None
    with pytest.raises(RuntimeError, match="gate has 40 rows, up 8"):
        torch.ops.crane_mp.gguf_gate_up_silu_int8(x, gate[1], up[1][:8], gate[0], up[0], cols)


def test_a_gated_mlp_over_gguf_parts_takes_silu_in_the_kernel_call_unless_an_adapter_adapts_gate_up(monkeypatch):
    """GatedMLP over a GGUF gate/up projection asks the kernels for the fused call (same bits as before);
    a LoRA adapter on gate_up adds to its output before SiLU, so then the parts' output is computed."""
    from types import SimpleNamespace

    from crane_mp.worker.models.layers import GatedMLP
    from crane_mp.worker.platforms import platform_for
    from crane_mp.worker.quantized.layers import GGUFLinear
    from crane_mp.worker.step.forward_context import forward_context

    kernels = platform_for("cpu").gguf
    hidden, width = 256, 64

    def part(qtype: int, rows: int, cols: int, seed: int) -> tuple[int, torch.Tensor]:
        return kernels.layout(qtype, torch.from_numpy(quantized(qtype, rows, cols, seed=seed).copy()), cols, True)

    config = SimpleNamespace(shard=None, hidden_size=hidden, intermediate_size=width, mlp_bias=False,
                             hidden_act="silu")
    mlp = GatedMLP(config, torch.ops.crane_mp)
    mlp.gate_up_proj = GGUFLinear(hidden, [part(T.Q4_K, width, hidden, 1), part(T.Q6_K, width, hidden, 2)], None,
                                  kernels, int8=True)
    mlp.down_proj = GGUFLinear(width, [part(T.Q8_0, hidden, width, 3)], None, kernels, int8=True)
    fused_calls = []
    fused = kernels.gate_up_silu
    monkeypatch.setattr(kernels, "gate_up_silu", lambda *args, **kw: fused_calls.append(1) or fused(*args, **kw))
    x = torch.from_numpy(activations(20, hidden, seed=5)).bfloat16()
    gate_up = mlp.gate_up_proj(x)

    def same(got: torch.Tensor, want: torch.Tensor) -> None:  # random weights' extreme rows overflow to NaN
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)

    with forward_context(SimpleNamespace(lora=None)):
        same(mlp(x), mlp.down_proj(torch.ops.crane_mp.silu_and_mul(gate_up)))
    assert len(fused_calls) == 1
    mlp.lora_gate_up_proj = {7: "adapter"}
    adapted = SimpleNamespace(apply=lambda inputs, outputs, adapters: outputs + 1)
    with forward_context(SimpleNamespace(lora=adapted)):
        same(mlp(x), mlp.down_proj(torch.ops.crane_mp.silu_and_mul(gate_up + 1)))
    assert len(fused_calls) == 1
