"""The GGUF decode matmul on CUDA (triton_dequant.py): K split across programs against no split, other
weight rows per program, dequantizing to a bf16 slab for cuBLAS, and cuBLAS on a bf16 matrix of the
same shape (what the device does with 16-bit weights), on Qwen3-8B's projection shapes.

    python benchmarks/gguf_cuda_splits.py [--types Q4_K Q6_K Q8_0] [--rows 1 8]

Decode reads each quantized weight once per step, so the figure that matters is weight GB/s against
the device-to-device copy bandwidth measured first (read + write). Each call rotates over three
copies of the matrix so that L2 (50-60 MB) never holds the one being read. Prints one JSON line per
(type, shape, rows).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.testing.random_gguf import random_blocks
from crane_mp.worker.quantized.triton_dequant import BLOCK_ROWS, _blockwise_matmul, blockwise_splits, triton_dequantize

SHAPES = {"qkv": (6144, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
_COPIES = 3


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Read + write bytes per second of a device-to-device copy launched from the host (captured in a
    graph, a copy becomes a copy-engine node: ~2.7 TB/s on an H200 against ~4.2 TB/s)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (start.elapsed_time(end) / 1e3)


def milliseconds(fn, calls: int = 60) -> float:
    """GPU milliseconds per call: `calls` calls (passed the call number) captured in one CUDA graph and
    replayed, as decode steps run them. Timed as launched from Python, a kernel call costs the ~40 us
    of Triton's launch path on the host, more than most of these take on the device."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": round(bandwidth / 1e9)}))
    rng = np.random.default_rng(0)
    for name in args.types:
        qtype = T[name]
        for shape, (out_features, in_features) in SHAPES.items():
            weights = [torch.from_numpy(random_blocks(out_features, in_features, qtype, rng)).cuda()
                       for _ in range(_COPIES)]
            nbytes = weights[0].numel()
            for rows in args.rows:
                x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda") * 0.1
                auto = blockwise_splits(rows, out_features, qtype, in_features, x.device)
                row = {"type": name, "shape": shape, "rows": rows, "weight_mib": round(nbytes / 2**20, 1),
                       "auto_splits": auto}
                variants = [("split", auto, None), ("no_split", 1, None)]
                variants += [(f"split_rows{n}", None, n) for n in (32, 64, 128) if n != BLOCK_ROWS[qtype]]
                for label, splits, block_rows in variants:
                    ms = milliseconds(lambda i, s=splits, n=block_rows: _blockwise_matmul(
                        x, weights[i % _COPIES], qtype, in_features, s, n))
                    row[f"{label}_us"] = round(ms * 1e3, 1)
                    row[f"{label}_of_roofline"] = round(nbytes / (ms / 1e3) / bandwidth, 3)
                slab_ms = milliseconds(lambda i: x @ triton_dequantize(
                    weights[i % _COPIES], qtype, in_features, torch.bfloat16).T)
                row["dequant_cublas_us"] = round(slab_ms * 1e3, 1)
                dense = [torch.randn(out_features, in_features, dtype=torch.bfloat16, device="cuda")
                         for _ in range(_COPIES)]
                dense_ms = milliseconds(lambda i: x @ dense[i % _COPIES].T)
                row["bf16_cublas_of_roofline"] = round(dense[0].numel() * 2 / (dense_ms / 1e3) / bandwidth, 3)
                reference = x.float() @ triton_dequantize(weights[0], qtype, in_features, torch.float32).T
                for splits in (auto, 1):
                    got = _blockwise_matmul(x, weights[0], qtype, in_features, splits)
                    row[f"max_rel_err_splits_{splits}"] = float(((got.float() - reference).abs().max()
                                                                 / reference.abs().max()))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
