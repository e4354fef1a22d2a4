"""Prompts on the AMX-INT8 tiles (kernels/gguf_tiles.cpp) give the AVX512-VNNI kernels' outputs bit for bit:
the same repacked groups (Q4_K, Q6_K and Q4_0 by sixteen rows, Q8_0 by eight), the same integer sums, the
same float steps. The kernels run on software tiles everywhere the VNNI kernels do (their layouts, shapes
and arithmetic), and on the AMX tiles themselves where the CPU has them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.worker.kernels.cpu_isa import kernel_isa
from tests.unit.test_gguf_int8 import X16, _signed_q6_k_scales, activations
from tests.unit.test_gguf_kernels import quantized

pytestmark = pytest.mark.skipif(kernel_isa() is None, reason="native kernels disabled or not built")

OFF, AMX, EMULATED = 0, 1, 2


def _packed(qtype: int, rows: int, cols: int) -> tuple[torch.Tensor, int]:
    """GGUF rows of `qtype` in the layout the tile kernels read: Q4_K, Q6_K and Q4_0 by 16, Q8_0 by 8."""
    from crane_mp.worker.quantized.formats import Q4_0_X16, Q4_K_X16, Q6_K_X16, Q8_0_X8

    weight = torch.from_numpy(quantized(qtype, rows, cols, seed=rows + cols).copy())
    if qtype == T.Q6_K:
        _signed_q6_k_scales(weight)
    repack, packed_type = {T.Q4_K: (X16[T.Q4_K], Q4_K_X16), T.Q6_K: (X16[T.Q6_K], Q6_K_X16),
                           T.Q4_0: (X16[T.Q4_0], Q4_0_X16), T.Q8_0: ("gguf_repack_q8_0_x8", Q8_0_X8)}[qtype]
    return getattr(torch.ops.crane_mp, repack)(weight, cols), packed_type


class _Tiles:
    """gguf_tile_kernels(mode) for the block's duration."""

    def __init__(self, mode: int) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.previous = torch.ops.crane_mp.gguf_tile_kernels(self.mode)

    def __exit__(self, *exc) -> None:
        torch.ops.crane_mp.gguf_tile_kernels(self.previous)


def _modes_with_tiles() -> list:
    return [pytest.param(EMULATED, id="software-tiles"), pytest.param(AMX, id="amx-tiles")]


def _need(mode: int, qtype: int) -> None:
    """Skips where the kernels of `mode` cannot run; on AMX, fails (without faulting this process) where
    the start-up check in a child process does."""
    from crane_mp.worker.kernels import tile_check

    if not torch.ops.crane_mp.gguf_x16_supported(T.Q6_K if qtype == T.Q6_K else T.Q4_K):
        pytest.skip("this CPU or kernel tier lacks the sixteen-row kernels (AVX512-VNNI, VBMI for Q6_K)")
    if mode == AMX and not torch.ops.crane_mp.gguf_tiles_available():
        pytest.skip(f"no AMX-INT8 tiles here (kernel tier {kernel_isa()}): the software tiles stand in")
    if mode == AMX:
        passed, why = tile_check.run_check()
        assert passed, f"the AMX-INT8 tiles failed their check: {why}"


@pytest.mark.parametrize("mode", _modes_with_tiles())
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_0, T.Q8_0], ids=lambda t: T(t).name)
def test_tiles_equal_the_vnni_kernels_bit_for_bit(qtype, mode):
    """16 to 300 prompt rows (whole 16-row tiles, tails, several 64-row calls), weight groups first and
    weight tiles first; under 16 rows the VNNI kernels run either way."""
    _need(mode, qtype)
    shapes = {T.Q8_0: ((8, 32), (40, 800), (304, 1024)), T.Q4_0: ((16, 32), (48, 800), (304, 1024))}
    for rows, cols in shapes.get(qtype, ((16, 256), (48, 768), (304, 1024))):
        packed, packed_type = _packed(qtype, rows, cols)
        for batch in (1, 15, 16, 17, 33, 64, 65, 300):
            x = torch.from_numpy(activations(batch, cols, seed=batch))
            with _Tiles(OFF):
                want = torch.ops.crane_mp.gguf_linear_int8(x, packed, packed_type, cols)
            with _Tiles(mode):
                got = torch.ops.crane_mp.gguf_linear_int8(x, packed, packed_type, cols)
            assert torch.equal(got, want), (rows, cols, batch)


@pytest.mark.parametrize("mode", _modes_with_tiles())
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_0, T.Q8_0], ids=lambda t: T(t).name)
def test_long_rows_go_through_the_tiles_in_chunks_of_k_with_the_same_bits(qtype, mode):
    """Rows longer than a call's activations can keep in L2 (an 8B's down projection) go in chunks of K,
    each call adding to the sums of the one before: the VNNI kernels' outputs bit for bit, float32 and
    rounded to bfloat16, over one pass and two (K past the last whole super-block for Q4_0 and Q8_0)."""
    _need(mode, qtype)
    cols = 6400 if qtype in (T.Q4_K, T.Q6_K) else 6432
    packed, packed_type = _packed(qtype, 32, cols)
    for batch in (16, 40, 300):
        x = torch.from_numpy(activations(batch, cols, seed=batch))
        with _Tiles(OFF):
            want = torch.ops.crane_mp.gguf_linear_int8(x, packed, packed_type, cols)
        with _Tiles(mode):
            got = torch.ops.crane_mp.gguf_linear_int8(x, packed, packed_type, cols)
            rounded = torch.ops.crane_mp.gguf_linear_int8(x.bfloat16(), packed, packed_type, cols)
            from_floats = torch.ops.crane_mp.gguf_linear_int8(x.bfloat16().float(), packed, packed_type, cols)
        assert torch.equal(got, want), batch
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, from_floats.bfloat16()), batch


@pytest.mark.parametrize("mode", _modes_with_tiles())
def test_tiles_serve_experts_and_a_layer_s_parts(mode):
    """Mixture experts' runs (each 16 rows or more on tiles, fewer on the VNNI kernels, in one call), a
    layer's Q4_K and Q6_K parts side by side, and gate and up with SiLU in one call, over more rows than a
    call takes (two passes), give the same bits as without tiles."""
    _need(mode, T.Q6_K)
    cols = 512
    experts = [_packed(T.Q4_K, 32, cols)[0] for _ in range(3)]
    runs = [0, 21, 5, 290]  # the last run two calls' rows (two passes), the others one
    ws = [experts[0], experts[1], experts[2], experts[0]]
    x = torch.from_numpy(activations(sum(runs), cols, seed=3))
    q4, q4_type = _packed(T.Q4_K, 48, cols)
    q6, q6_type = _packed(T.Q6_K, 32, cols)
    up, _ = _packed(T.Q6_K, 48, cols)
    long_prompt = torch.from_numpy(activations(300, cols, seed=5))

    def outputs() -> tuple[torch.Tensor, ...]:
        grouped = torch.ops.crane_mp.gguf_grouped_linear_int8(x, ws, runs, q4_type, cols)
        parts = torch.ops.crane_mp.gguf_linear_parts_int8(long_prompt, [q4, q6], [q4_type, q6_type], cols)
        gated = torch.ops.crane_mp.gguf_gate_up_silu_int8(long_prompt, q4, up, q4_type, q6_type, cols)
        return grouped, parts, gated

    with _Tiles(OFF):
        want = outputs()
    with _Tiles(mode):
        got = outputs()
    for one, other in zip(got, want):
        torch.testing.assert_close(one, other, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("mode", _modes_with_tiles())
def test_bfloat16_prompts_on_tiles_are_rounded_as_the_float_products_would_be(mode):
    """The tile kernels' products of bfloat16 activations are rounded a task at a time, never written out
    as float32: bit for bit the float products rounded after, for one matrix (tails of rows and of weight
    groups, two passes) and for a layer's parts side by side."""
    dtype = torch.bfloat16
    _need(mode, T.Q6_K)
    cols = 512
    q4, q4_type = _packed(T.Q4_K, 80, cols)
    q6, q6_type = _packed(T.Q6_K, 48, cols)
    for batch in (16, 33, 300):
        x = torch.from_numpy(activations(batch, cols, seed=batch)).to(dtype)
        with _Tiles(mode):
            for got, want in (
                (torch.ops.crane_mp.gguf_linear_int8(x, q4, q4_type, cols),
                 torch.ops.crane_mp.gguf_linear_int8(x.float(), q4, q4_type, cols).to(dtype)),
                (torch.ops.crane_mp.gguf_linear_parts_int8(x, [q4, q6], [q4_type, q6_type], cols),
                 torch.ops.crane_mp.gguf_linear_parts_int8(x.float(), [q4, q6], [q4_type, q6_type], cols).to(dtype)),
            ):
                assert got.dtype == dtype and got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_tile_modes_are_checked():
    with pytest.raises(RuntimeError, match="none of 0"):
        torch.ops.crane_mp.gguf_tile_kernels(3)
    if not torch.ops.crane_mp.gguf_tiles_available():
        with pytest.raises(RuntimeError, match="no AMX-INT8 tiles"):
            torch.ops.crane_mp.gguf_tile_kernels(AMX)
    if not torch.ops.crane_mp.gguf_x16_supported(T.Q4_K):
        with pytest.raises(RuntimeError, match="emulated tiles need the AVX512-VNNI kernels"):
            torch.ops.crane_mp.gguf_tile_kernels(EMULATED)
        return
    with _Tiles(OFF):  # each call returns the mode it replaced
        assert torch.ops.crane_mp.gguf_tile_kernels(EMULATED) == OFF
        assert torch.ops.crane_mp.gguf_tile_kernels(OFF) == EMULATED


def test_the_start_up_check_compares_every_tile_kernel(monkeypatch):
    """The child's comparison (tile_check.compare) on software tiles: it passes on right kernels, and names
    the difference when the tiles' outputs are off by a rounding."""
    from crane_mp.worker.kernels import tile_check

    _need(EMULATED, T.Q4_K)
    with _Tiles(OFF):
        assert tile_check.compare(EMULATED) is None
        assert torch.ops.crane_mp.gguf_tile_kernels(OFF) == OFF  # compare() leaves the mode it found

    from crane_mp.worker.quantized.formats import Q6_K_X16

    ops, linear = torch.ops.crane_mp, torch.ops.crane_mp.gguf_linear_int8

    def off_on_tiles(x, w, qtype, cols):
        mode = ops.gguf_tile_kernels(OFF)
        ops.gguf_tile_kernels(mode)
        out = linear(x, w, qtype, cols)
        return out if mode == OFF or qtype != Q6_K_X16 else torch.nextafter(out, out + 1)

    monkeypatch.setattr(ops, "gguf_linear_int8", off_on_tiles)
    assert tile_check.compare(EMULATED).startswith("Q6_K, 16 rows: the tiles differ from the VNNI kernels by up to")


def test_a_failed_tile_check_keeps_the_vnni_kernels(monkeypatch, caplog):
    """Where the child's check fails (a fault, different bits) prompts stay on the VNNI kernels, said once."""
    from crane_mp.worker.kernels import tile_check

    monkeypatch.setattr(tile_check, "kernel_isa", lambda: "amx")
    monkeypatch.setattr(torch.ops.crane_mp, "gguf_tiles_available", lambda: True, raising=False)
    monkeypatch.setattr(tile_check, "run_check", lambda: (False, "exited -11 (SIGSEGV)"))
    tile_check.int8_tiles.cache_clear()
    try:
        with _Tiles(OFF), caplog.at_level("WARNING"):
            assert tile_check.int8_tiles() is False
            assert torch.ops.crane_mp.gguf_tile_kernels(OFF) == OFF
        assert [r.getMessage() for r in caplog.records if "AMX-INT8" in r.getMessage()] == [
            "AMX-INT8 tiles failed their check on this host (exited -11 (SIGSEGV)); GGUF prompts keep the "
            "AVX512-VNNI kernels"]
    finally:
        tile_check.int8_tiles.cache_clear()


def test_a_check_s_verdict_is_kept_unless_no_child_answered(monkeypatch, tmp_path):
    import subprocess

    from crane_mp.worker.kernels import tile_check

    children = []

    def crashing(cmd, **kwargs):
        children.append(cmd)
        return subprocess.CompletedProcess(cmd, -4, "", "loading tiles\nIllegal instruction\n")

    monkeypatch.setattr(tile_check, "_verdict_file", lambda: tmp_path / "verdict")
    monkeypatch.setattr(tile_check.subprocess, "run", crashing)
    assert tile_check.run_check() == (False, "exited -4: Illegal instruction")
    assert tile_check.run_check() == (False, "exited -4: Illegal instruction")
    assert children == [[tile_check.sys.executable, "-m", "crane_mp.worker.kernels.tile_check"]]

    def silent(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    (tmp_path / "verdict").unlink()
    monkeypatch.setattr(tile_check.subprocess, "run", silent)
    assert tile_check.run_check() == (False, "no answer in 600 s")
    assert not (tmp_path / "verdict").exists()

    def refused(cmd, **kwargs):
        raise PermissionError("fork refused")

    monkeypatch.setattr(tile_check.subprocess, "run", refused)
    assert tile_check.run_check() == (False, "no child process: fork refused")
    assert not (tmp_path / "verdict").exists()
