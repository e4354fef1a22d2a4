"""Compile Triton kernels for NVIDIA GPUs on a machine without one: what the interpreter tests cannot
see (tl.dot shapes, dtype rules, shared memory, register spills) is decided by Triton's compiler and
ptxas, which both ship in Triton's wheel.

`recorded_launches` runs the kernels' Python wrappers with CPU tensors and records each launch
instead of running it; `compile_launch` builds that launch as Triton's JIT would on the GPU (the same
argument specialisation: alignment, integers equal to 1) for a given compute capability.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

# Largest dynamic shared memory one block may use (CUDA programming guide, compute capabilities).
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def nvidia_backend_available() -> bool:
    return os.access(_CUOBJDUMP, os.X_OK) and "nvidia" in triton.backends.backends


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


def compile_launch(launch: Launch, capability: int) -> Compiled:
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound, specialization, options = bind(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, launch.kwargs, bound, specialization,
                                                                     options)
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return Compiled(kernel.metadata.shared, int(found[1]), int(found[2]))
