"""The CPU tier probe, the CRANE_MP_ISA cap, and what follows from them: dtype, packing, kernel builds."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch

from crane_mp.config import CPU_ISAS, EngineConfig, cpu_isa_cap
from crane_mp.engine import LLMEngine
from crane_mp.models.config import load_model_config
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_model import make_model
from crane_mp.worker.kernels import cpu_isa, loader
from crane_mp.worker.kernels.loader import build_name, kernel_cache_dir
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.weights.cpu_packing import PackedLinear
from tests.model_helpers import load_checkpoint, prefill_logits

CPU = torch.device("cpu")


def rank(tier: str) -> int:
    return CPU_ISAS.index(tier)


def test_cap_is_parsed_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("CRANE_MP_ISA", " AVX512_bf16")
    assert cpu_isa_cap() == "avx512_bf16"
    monkeypatch.setenv("CRANE_MP_ISA", "sse4")
    with pytest.raises(ValueError, match="CRANE_MP_ISA='sse4'.*avx2, avx512, avx512_bf16, amx"):
        cpu_isa_cap()
    monkeypatch.delenv("CRANE_MP_ISA")
    assert cpu_isa_cap() is None


def test_tier_in_use_never_exceeds_the_host_or_the_cap():
    host, isa, cap, kernels = cpu_isa.host_isa(), cpu_isa.cpu_isa(), cpu_isa_cap(), cpu_isa.kernel_isa()
    if host is None:
        assert isa is None and kernels is None
        return
    assert rank(isa) == (rank(host) if cap is None else min(rank(host), rank(cap)))
    assert kernels is None or rank(kernels) <= rank(isa)
    assert platform_for(CPU).describe() == (isa, kernels or "portable")
    assert platform_for("cuda").describe()[1] == "n/a"  # a GPU worker builds no CPU kernels


@pytest.mark.parametrize("tier", CPU_ISAS)
def test_dtype_and_packing_follow_the_tier(monkeypatch, tier):
    monkeypatch.setattr(cpu_isa, "cpu_isa", lambda: tier)
    native_bf16 = rank(tier) >= rank("avx512_bf16")
    assert cpu_isa.cpu_dtype(None, torch.bfloat16) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert cpu_isa.cpu_dtype(None, torch.float16) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert cpu_isa.cpu_dtype(None, torch.float32) == torch.float32
    assert cpu_isa.cpu_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # explicit is honoured
    # oneDNN's bf16 reorder raises below AVX-512 BW/VL/DQ: never asked for there.
    assert cpu_isa.pack_bf16_weights(torch.bfloat16) == (tier != "avx2" and torch.backends.mkldnn.is_available())
    # A float32 model's bf16-valued weights are packed for the widened kernel where the kernels run without bf16 math.
    assert cpu_isa.pack_bf16_weights(torch.float32) == (cpu_isa.kernel_isa() in ("avx2", "avx512"))


def test_explicit_bf16_without_native_bf16_says_so_in_one_line(monkeypatch, caplog):
    monkeypatch.setattr(cpu_isa, "cpu_isa", lambda: "avx2")
    with caplog.at_level(logging.WARNING, logger=cpu_isa.__name__):
        assert cpu_isa.cpu_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    [record] = caplog.records
    assert "--dtype bfloat16" in record.getMessage() and "isa=avx2" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_each_tier_and_compiler_builds_under_its_own_name():
    names = {tier: build_name(tier, "gcc12_2_0", "c++ 12.2.0") for tier in CPU_ISAS}
    assert len(set(names.values())) == len(CPU_ISAS)
    assert all(name.startswith(f"crane_mp_cpu_{tier}_gcc12_2_0_") for tier, name in names.items())
    assert build_name("avx2", "gcc13_1_0", "c++ 13.1.0") != names["avx2"]


def test_each_environment_builds_under_its_own_name(monkeypatch):
    """torch writes its own and Python's include and library paths into the build file: two virtual
    environments sharing one cache under one name would each rebuild after the other's start."""
    from torch.utils import cpp_extension

    here = build_name("avx2", "gcc12_2_0", "c++ 12.2.0")
    other = [path.replace("site-packages", "other-venv-site-packages") for path in cpp_extension.include_paths()]
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *args, **kwargs: other)
    assert build_name("avx2", "gcc12_2_0", "c++ 12.2.0") != here


def test_builds_run_the_environments_own_ninja_whatever_path_the_server_has(monkeypatch, tmp_path):
    """Two ninja versions read each other's build log as every command changed: a server started with
    a system ninja first on PATH, then from an activated environment, recompiled everything each time.
    The package's ninja comes first on the build's PATH, and its version is part of the build's name."""
    ninja = pytest.importorskip("ninja")
    system = tmp_path / "bin"
    system.mkdir()
    (system / "ninja").write_text("#!/bin/sh\necho 1.0.0\n")
    (system / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{system}{os.pathsep}{os.environ.get('PATH', '')}")
    cached = loader.ninja_version
    cached.cache_clear()
    try:
        assert loader._build_env_path().split(os.pathsep)[0] == ninja.BIN_DIR
        assert loader.ninja_version() not in ("", "1.0.0")
        ours = build_name("avx2", "gcc12_2_0", "c++ 12.2.0")
        monkeypatch.setattr(loader, "ninja_version", lambda: "1.0.0")
        assert build_name("avx2", "gcc12_2_0", "c++ 12.2.0") != ours
    finally:
        cached.cache_clear()


@pytest.mark.slow  # every native source compiled once per tier: a minute and a half each on two cores
@pytest.mark.parametrize("tier", ["avx512", "amx"])  # the amx flags hold every other tier's, avx512 none
def test_kernels_compile_for_tiers_this_cpu_cannot_run(tier, tmp_path):
    """A tier above this CPU's is never built here, yet another machine will build it: every source
    must at least compile with that tier's flags (the intrinsics its #if branches use)."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    if loader.compiler_identity() is None:
        pytest.skip("no C++ compiler")
    if cpu_isa_cap() is not None:
        pytest.skip("a capped run (CI's second pass) repeats the uncapped one's compiles")
    if cpu_isa.host_isa() is not None and rank(cpu_isa.host_isa()) >= rank(tier):
        pytest.skip(f"this CPU builds and runs {tier} itself")
    from concurrent.futures import ThreadPoolExecutor

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]

    def compile_one(source):
        cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O0", "-w", *loader.TIER_FLAGS[tier], "-fopenmp",
               *includes, "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")]
        return source, subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    sources, host = loader._SOURCES, cpu_isa.host_isa()
    if tier == "amx" and host is not None and rank(host) >= rank("avx512_bf16"):
        # This CPU builds every source with avx512_bf16's flags, which amx's only extend by the tile
        # instructions: the sources that use those (themselves or through a header) are what is left.
        sources = [source for source in sources if _uses_amx(source)]
        assert sources
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one compiler per core
        for source, run in pool.map(compile_one, sources):
            assert run.returncode == 0, f"{source.name} for {tier}: {run.stderr[-2000:]}"


def _uses_amx(source) -> bool:
    """The source, or a header of ours it includes, has #if __AMX_*__ branches (not only a comment on AMX)."""
    text = source.read_text()
    headers = [header for header in loader._HEADERS if f'"{header.name}"' in text]
    return any("__AMX_" in file.read_text() for file in [source, *headers])


def test_kernel_cache_falls_back_to_a_private_temporary_directory(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("CRANE_MP_CACHE", str(blocker / "cache"))
    fallback = kernel_cache_dir()
    assert fallback.is_dir() and os.access(fallback, os.W_OK)
    assert fallback.parent == type(fallback)(tempfile.gettempdir())
    monkeypatch.setenv("CRANE_MP_CACHE", str(tmp_path / "cache"))
    assert kernel_cache_dir() == tmp_path / "cache" / "kernels"


def test_a_cache_others_may_write_is_never_used(monkeypatch, tmp_path):
    shared = tmp_path / "shared" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o777)  # anyone could plant a library here
    monkeypatch.setenv("CRANE_MP_CACHE", str(tmp_path / "shared"))
    chosen = kernel_cache_dir()
    assert chosen != shared and chosen.parent == type(chosen)(tempfile.gettempdir())
    shared.chmod(0o755)
    assert kernel_cache_dir() == shared


def test_kernels_build_from_copies_every_checkout_shares(tmp_path):
    """torch's build file names the sources by path: builds read copies inside the build directory, so
    two checkouts of the same sources sharing one cache do not recompile each other's build."""
    sources = loader._staged_sources(tmp_path)
    assert sources == [str(tmp_path / "src" / p.name) for p in loader._SOURCES]
    for path in loader._SOURCES + loader._HEADERS:
        assert (tmp_path / "src" / path.name).read_bytes() == path.read_bytes()
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "src").iterdir()}
    loader._staged_sources(tmp_path)  # unchanged sources are not rewritten (ninja would rebuild)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "src").iterdir()} == stamps


def test_explicit_bf16_serves_on_this_tier(tmp_path):
    # Whatever the tier: packed only where allowed, logits of float32's within bf16 rounding, and an
    # engine that generates.
    path = make_model("qwen3", "tiny", tmp_path / "q", dtype="float32")
    config = load_model_config(path)
    models = {dtype: load_checkpoint(config, path, dtype) for dtype in (torch.bfloat16, torch.float32)}
    packed = any(isinstance(m, PackedLinear) for m in models[torch.bfloat16].modules())
    assert packed == cpu_isa.pack_bf16_weights(torch.bfloat16)
    exact, rounded = (prefill_logits(models[dtype], list(range(3, 40))) for dtype in (torch.float32, torch.bfloat16))
    assert (rounded - exact).norm() / exact.norm() < 0.05  # bf16 weights and activations: ~1.5% here
    margin = exact.max(-1).values - exact.gather(1, rounded.argmax(-1, keepdim=True)).squeeze(1)
    assert (margin == 0).float().mean() >= 0.9 and margin.max() < 0.3  # argmax differs only at near-ties
    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="bfloat16", force_cpu=True, max_model_len=64))
    assert engine.worker.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [len(out) for out in engine.generate([[5, 6, 7, 8], [9, 10, 11], [3]], params)] == [8, 8, 8]
