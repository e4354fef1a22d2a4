"""Quantized matmul kernels at the size people run, weights streamed from DRAM.

    python benchmarks/gguf_kernels.py [--types Q4_K Q6_K Q8_0] [--rows 1 4 16 64]

For each Qwen3-8B projection shape and type: milliseconds per call, weight GB/s (what bounds decode)
and GFLOP/s (what bounds batched steps and prompts) of the float-activation kernel (gguf_matmul.cpp),
the 8-bit one on GGUF's rows (gguf_int8.cpp) and, for Q4_K, Q6_K and Q8_0, on rows repacked
(gguf_repack.cpp) as the server loads them (`int8_x8`: eight rows at a time, sixteen for Q6_K on CPUs
with VBMI; on AMX hosts, prompts of 16 rows or more through the tiles, and `tiles_vs_vnni` their time
over the VNNI kernels', alternating). Calls rotate over three copies of each matrix (more than any L3),
and the DRAM read bandwidth (2 GiB torch.sum) is measured first. Prints one JSON line per row count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.testing.random_gguf import random_blocks
from crane_mp.worker.kernels.cpu_isa import kernel_isa
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.platforms.device import prefer_huge_pages

SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096)}
_COPIES = 3


def per_call(fn, weights: list[torch.Tensor], min_time: float = 0.3) -> float:
    """Median over 5 runs of the mean seconds per call, rotating over `weights`."""
    fn(weights[0])
    runs = []
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_time / 5 or calls < 2:
            fn(weights[calls % len(weights)])
            calls += 1
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def tiles_vs_vnni(fn, weights: list[torch.Tensor], rounds: int = 5) -> float:
    """Median over `rounds` of a call's time on the AMX-INT8 tiles over its time on the VNNI kernels, the
    two alternating (this host's speed drifts within minutes)."""
    ops = torch.ops.crane_mp

    def timed_call(mode: int, w: torch.Tensor) -> float:
        previous = ops.gguf_tile_kernels(mode)
        try:
            fn(w)
            return _timed(lambda: fn(w))
        finally:
            ops.gguf_tile_kernels(previous)

    ratios = []
    for i in range(rounds):
        w = weights[i % len(weights)]
        vnni = timed_call(0, w)
        ratios.append(timed_call(1, w) / vnni)
    return statistics.median(ratios)


def dram_gbs() -> float:
    x = torch.ones(1 << 29)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return round((1 << 31) / best / 1e9, 1)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    prefer_huge_pages()  # repacked weights in the pages the server gives them
    if kernel_isa() is None:
        raise SystemExit("native kernels are not built (CRANE_MP_NO_NATIVE_KERNELS set, or no compiler)")
    platform = platform_for("cpu")
    isa, kernels = platform.describe()
    print(json.dumps({"bench": "dram", "read_gbs": dram_gbs(), "isa": f"{isa}/{kernels}"}), flush=True)
    rng = np.random.default_rng(0)
    ops = torch.ops.crane_mp
    # On, where the platform turned GGUF prompts onto the AMX-INT8 tiles (their start-up check passed).
    tiles = ops.gguf_tile_kernels(0) == 1
    if tiles:
        ops.gguf_tile_kernels(1)
    for qname in args.types:
        qtype = T[qname]
        for shape in args.shapes:
            n, k = SHAPES[shape]
            weights = [torch.from_numpy(random_blocks(n, k, qtype, rng)) for _ in range(_COPIES)]
            layouts = [platform.gguf.layout(qtype, w, k, int8=True) for w in weights]
            packed_type = layouts[0][0]
            repacked = [w for _, w in layouts] if packed_type != qtype else None
            for m in args.rows:
                x = torch.randn(m, k) * 0.1
                times = {
                    "float": per_call(lambda w: ops.gguf_linear(x, w, qtype, k), weights),
                    "int8": per_call(lambda w: ops.gguf_linear_int8(x, w, qtype, k), weights),
                }
                if repacked is not None:
                    times["int8_x8"] = per_call(lambda w: ops.gguf_linear_int8(x, w, packed_type, k), repacked)
                    if tiles:
                        ratio = tiles_vs_vnni(lambda w: ops.gguf_linear_int8(x, w, packed_type, k), repacked)
                row = {"bench": "gguf_kernels", "isa": f"{isa}/{kernels}", "type": qname, "shape": shape, "N": n,
                       "K": k, "M": m}
                for name, seconds in times.items():
                    row[f"{name}_ms"] = round(seconds * 1e3, 3)
                    row[f"{name}_weight_gbs"] = round(weights[0].numel() / seconds / 1e9, 1)
                    row[f"{name}_gflops"] = round(2 * m * n * k / seconds / 1e9, 1)
                if repacked is not None and tiles:
                    row["tiles_vs_vnni"] = round(ratio, 3)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
