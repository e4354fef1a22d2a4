"""Compile Triton kernels for NVIDIA GPUs on a machine without one: what the interpreter tests cannot
see (tl.dot shapes, dtype rules, shared memory, register spills) is decided by Triton's compiler and
ptxas, which both ship in Triton's wheel.

`recorded_launches` runs the kernels' Python wrappers with CPU tensors and records each launch
instead of running it (the *_launches functions drive the wrappers as a model's forward pass does);
`compile_launch` builds that launch as Triton's JIT would on the GPU (the same argument
specialisation: alignment, integers equal to 1) for a given compute capability. Used by
tests/unit/test_triton_compile.py and benchmarks/triton_resources.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import crane_mp.worker.kernels.triton_common  # noqa: F401 - the kernels' compile settings, set before any compile

# Largest dynamic shared memory one block may use (CUDA programming guide, compute capabilities).
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def nvidia_backend_available() -> bool:
    """Triton's NVIDIA backend is installed and its JIT binds arguments as this module expects (the
    binding goes through Triton internals that may change between releases)."""
    if not (os.access(_CUOBJDUMP, os.X_OK) and "nvidia" in triton.backends.backends):
        return False
    try:
        _source(Launch(_probe_kernel, (torch.empty(4),), {"BLOCK": 4}), GPUTarget("cuda", 90, 32))
    except (AttributeError, TypeError, ValueError, KeyError):
        return False
    return True


@triton.jit
def _probe_kernel(x_ptr, BLOCK: triton.language.constexpr):
    triton.language.store(x_ptr + triton.language.arange(0, BLOCK), 0.0)


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclass(frozen=True)
class Compiled:
    shared_bytes: int
    num_warps: int
    registers: int
    stack_bytes: int  # per thread; non-zero means registers spilled to local memory


@contextlib.contextmanager
def recorded_launches():
    """Within the block, kernel launches append a Launch to the yielded list and run nothing."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _source(launch: Launch, target: GPUTarget) -> tuple[ASTSource, dict]:
    """The launch's source and compile options, specialised as Triton's JIT does at a kernel call."""
    backend = make_backend(target)
    bind = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound, specialization, options = bind(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, launch.kwargs, bound, specialization,
                                                                     options)
    return ASTSource(launch.kernel, signature, constexprs, attrs), options.__dict__


def compile_launch(launch: Launch, capability: int) -> Compiled:
    target = GPUTarget("cuda", capability, 32)
    source, options = _source(launch, target)
    kernel = triton.compile(source, target=target, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return Compiled(kernel.metadata.shared, kernel.metadata.num_warps, int(found[1]), int(found[2]))


# The launches compile_launches' forked workers compile, by index (a JITFunction does not pickle).
_FORKED_LAUNCHES: list[Launch] = []


def _compile_forked(index: int, capability: int) -> Compiled:
    return compile_launch(_FORKED_LAUNCHES[index], capability)


def compile_launches(launches: list[Launch], capability: int) -> list[Compiled]:
    """compile_launch of every launch, in one forked process per core: each compile is one thread's work
    (Triton's passes, then ptxas), and a test runs alone, so the other cores would sit idle."""
    global _FORKED_LAUNCHES
    workers = min(len(launches), os.cpu_count() or 1)
    if workers <= 1:
        return [compile_launch(launch, capability) for launch in launches]
    _FORKED_LAUNCHES = launches
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.starmap(_compile_forked, [(i, capability) for i in range(len(launches))], chunksize=1)
    finally:
        _FORKED_LAUNCHES = []


def attention_launches(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Decode (one split and the most splits, with its merge) and prefill over a paged cache, the
    most splits and prefill also with soft-capped logits (Gemma 2), prefill also with per-row key limits
    (Gemma 3's images)."""
    from crane_mp.worker.kernels import triton_attention as kernels

    cache = torch.empty(8, 16, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(4, 8, dtype=torch.long)  # int64, as attention.py and decode_graphs.py pass them
    lengths = torch.zeros(4, dtype=torch.long)
    q = torch.empty(4, heads, head_dim, dtype=dtype)
    for splits in (1, 16):
        workspace = kernels.decode_workspace(4, heads, head_dim, splits, "cpu")
        kernels.paged_decode(q, cache, cache, tables, lengths, torch.empty_like(q), 0.1, 0, splits, workspace)
    kernels.paged_decode(q, cache, cache, tables, lengths, torch.empty_like(q), 0.1, 0, 16, workspace, softcap=50.0)
    chunk = torch.empty(100, heads, head_dim, dtype=dtype)
    for softcap in (0.0, 50.0):
        kernels.paged_prefill(chunk, cache, cache, tables, lengths, lengths, lengths, 100, torch.empty_like(chunk),
                              0.1, 4096, softcap)
    kernels.paged_prefill(chunk, cache, cache, tables, lengths, lengths, lengths, 100, torch.empty_like(chunk),
                          0.1, 1024, 0.0, torch.zeros(100, dtype=torch.int32))


def elementwise_launches(dtype: torch.dtype, hidden: int, intermediate: int, heads: int, kv_heads: int,
                         head_dim: int) -> None:
    """RMSNorm (alone and with the residual add), SiLU*mul, and q/k norm + rope + KV write (no norm,
    before rope, after rope)."""
    from crane_mp.worker.kernels import triton_elementwise as kernels

    x = torch.empty(3, hidden, dtype=dtype)
    kernels.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6)
    kernels.add_rms_norm_(x, torch.empty_like(x), torch.empty(hidden, dtype=dtype), 1e-6)
    kernels.silu_and_mul(torch.empty(3, 2 * intermediate, dtype=dtype))
    cache = torch.empty(8, 16, kv_heads, head_dim, dtype=dtype)
    qkv = torch.empty(5, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    rope = torch.empty(5, head_dim, dtype=dtype)
    for norm_position in (0, 1, 2):
        kernels.qkv_rope_cache(qkv, rope, rope, torch.empty(heads + kv_heads, head_dim, dtype=dtype), norm_position,
                               1e-6, torch.zeros(5, dtype=torch.int64), cache, cache, heads)


def gguf_launches(dtype: torch.dtype, in_features: int = 4096) -> None:
    """Slab dequantization and the fused decode matmul, for every GGUF format with Triton kernels."""
    from crane_mp.worker.quantized import triton_dequant as kernels
    from crane_mp.worker.quantized.formats import LAYOUTS

    for qtype in sorted(kernels.TRITON_TYPES):
        layout = LAYOUTS[qtype]
        weight = torch.empty(64, in_features // layout.block * layout.bytes, dtype=torch.uint8)
        kernels.triton_dequantize(weight, qtype, in_features, dtype)
        kernels.triton_quantized_matmul(torch.empty(8, in_features, dtype=dtype), weight, qtype, in_features)


def experts_launches(dtype: torch.dtype) -> None:
    """The grouped expert matmuls: gate/up from the tokens' rows and down from the pairs' own, at a
    30B-A3B mixture's shapes (128 experts, top 8, hidden 2048, 768 wide)."""
    from crane_mp.worker.kernels import triton_moe as kernels

    ids = torch.zeros(4, 8, dtype=torch.long)
    blocks = kernels.PairBlocks(ids, 128, kernels.block_rows(dtype))
    kernels.grouped_matmul(torch.empty(4, 2048, dtype=dtype), torch.empty(128, 1536, 2048, dtype=dtype), blocks, 8)
    kernels.grouped_matmul(torch.empty(32, 768, dtype=dtype), torch.empty(128, 2048, 768, dtype=dtype), blocks, 1)


def skinny_launches(dtype: torch.dtype) -> None:
    """The decode matmul of few rows, every candidate config, for one and several rows, with and
    without a bias, on a shape that divides the tiles and one that does not; one bf16 row also with each
    input prologue (the RMSNorm with and without the residual add, SiLU*mul)."""
    from crane_mp.worker.kernels import triton_skinny as kernels

    for out_features, in_features in ((4096, 12288), (1000, 1000)):
        weight = torch.empty(out_features, in_features, dtype=dtype)
        norm = (torch.empty(in_features, dtype=dtype), 1e-6)
        for rows in (1, 8):
            x = torch.empty(rows, in_features, dtype=dtype)
            for config in kernels.candidates_for(rows):
                kernels.skinny_linear(x, weight, None, config)
                kernels.skinny_linear(x, weight, torch.empty(out_features, dtype=dtype), config)
                if rows <= kernels.PROLOGUE_ROWS and dtype == torch.bfloat16:  # float16 compiles alike
                    kernels.skinny_linear(x, weight, None, config, norm=norm)
                    kernels.skinny_linear(x, weight, None, config, norm=norm, residual=torch.empty_like(x))
                    kernels.skinny_linear(torch.empty(rows, 2 * in_features, dtype=dtype), weight, None, config,
                                          silu_mul=True)
