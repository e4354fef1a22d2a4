"""Quantized matmul kernels (kernels/gguf_matmul.cpp) against float32 matmuls of the same shapes.

    python benchmarks/gguf_kernels.py [--types Q8_0 Q4_K Q6_K] [--rows 1 4 8 32 128]

For each Qwen3-0.6B projection shape: microseconds per call, weight GB/s (what bounds decode), and
the float32 torch matmul on a dense copy of the weight for reference. Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.testing import kquants
from crane_mp.worker.kernels.cpu_isa import describe, kernel_isa

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
_K = {"Q4_K": kquants.quantize_q4_k, "Q5_K": kquants.quantize_q5_k, "Q6_K": kquants.quantize_q6_k}


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    return _K[name](w) if name in _K else gguf.quants.quantize(w, T[name])


def bench(fn, min_time: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K", "Q6_K"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 128])
    args = parser.parse_args()
    if kernel_isa() is None:
        raise SystemExit("native kernels are not built (CRANE_MP_NO_NATIVE_KERNELS set, or no compiler)")
    isa, kernels = describe(torch.device("cpu"))
    rng = np.random.default_rng(0)
    for qname in args.types:
        qtype = T[qname]
        for shape_name, (n, k) in SHAPES.items():
            dense = rng.standard_normal((n, k)).astype(np.float32)
            weight = torch.from_numpy(quantize(dense, qname))
            dense_t = torch.from_numpy(dense)
            for m in args.rows:
                x = torch.randn(m, k)
                ours = bench(lambda: torch.ops.crane_mp.gguf_linear(x, weight, qtype, k))
                ref = bench(lambda: x @ dense_t.T)
                print(json.dumps({
                    "bench": "gguf_kernels", "isa": f"{isa}/{kernels}", "type": qname, "shape": shape_name, "N": n,
                    "K": k, "M": m, "us": round(ours * 1e6, 1), "weight_GB_s": round(weight.numel() / ours / 1e9, 2),
                    "fp32_dense_us": round(ref * 1e6, 1), "vs_fp32": round(ref / ours, 2),
                }), flush=True)


if __name__ == "__main__":
    main()
