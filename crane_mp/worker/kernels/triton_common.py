"""What every Triton kernel of the CUDA path shares: the dot product, made testable on CPU.

Triton's interpreter (TRITON_INTERPRET=1, how the kernels are tested without a GPU) multiplies 16-bit
operands as raw integers. There, dot products take them in float32, which is exact for bf16/fp16
products, as the GPU's float32-accumulating dot is.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Fused multiply-adds in the kernels, as tuned and tested; Triton 3.9 warns that its default turns
# them off in 3.10.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32; PRECISION ("ieee" or "tf32") applies to float32 operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
