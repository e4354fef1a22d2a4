"""The kernels of an 8B-shape decode step one at a time, against the memory bandwidth: each linear
projection at a few rows (cuBLAS and every Triton candidate that start-up chooses among), and decode
attention at batch 1 and 8 for each context split count, keys per iteration and warps.

    python benchmarks/gpu_kernels.py
    python benchmarks/gpu_kernels.py --rows 1 --attention-batches 1 --context 4096

Every kernel runs over one weight (or KV cache) per layer in turn, as a step reads them; one tensor
alone would sit in the GPU's L2 cache. Attention runs as a CUDA graph of all layers' calls, as decode
steps replay it. Fractions are of the device-to-device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gpu import measure_bandwidth

from crane_mp.worker.kernels import triton_attention, triton_skinny
from crane_mp.worker.kernels.skinny_linears import time_candidates

# Qwen3-8B: (out features, in features) of each projection, and how many the model holds.
MATMULS = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36),
           "down": (4096, 12288, 36), "lm_head": (151936, 4096, 1)}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def matmul_table(rows_list: list[int], dtype: torch.dtype, bandwidth: float) -> None:
    print("| projection | rows | cuBLAS us | best Triton us (config) | cuBLAS of bandwidth | best of bandwidth |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (out_features, in_features, count) in MATMULS.items():
        copies = max(count, 4)  # the LM head too is timed over several copies, out of L2
        weights = [(torch.randn(out_features, in_features, dtype=dtype, device="cuda"), None) for _ in range(copies)]
        seconds = out_features * in_features * weights[0][0].element_size() / bandwidth
        for rows in rows_list:
            timed = time_candidates(triton_skinny, weights, rows)
            best = min((c for c in timed if c is not None), key=timed.get)
            others = " ".join(f"{tuple(c)}={1e6 * t:.1f}" for c, t in timed.items() if c is not None)
            print(f"| {name} | {rows} | {1e6 * timed[None]:.1f} | {1e6 * timed[best]:.1f} {tuple(best)} | "
                  f"{seconds / timed[None]:.0%} | {seconds / timed[best]:.0%} |  <!-- {others} -->")
        del weights
        torch.cuda.empty_cache()


def attention_seconds(batch: int, context: int, layers: int, dtype: torch.dtype, splits: int, tile: int,
                      warps: int) -> float:
    per_seq = -(-context // BLOCK)
    caches = [(torch.randn(batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"),
               torch.randn(batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"))
              for _ in range(layers)]
    tables = torch.arange(batch * per_seq, device="cuda").view(batch, per_seq)
    ctx = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    workspace = triton_attention.decode_workspace(batch, HEADS, HEAD_DIM, splits, q.device)

    def step() -> None:
        for k, v in caches:
            triton_attention.paged_decode(q, k, v, tables, ctx, out, HEAD_DIM**-0.5, 0, splits, workspace,
                                          tile=tile, num_warps=warps)

    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / layers)
    return statistics.median(times)


def attention_table(batches: list[int], context: int, layers: int, dtype: torch.dtype, bandwidth: float) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\n| batch | splits | keys per iteration | warps | us per layer | of bandwidth |  (default splits: "
          + ", ".join(f"batch {b}: {triton_attention.decode_splits(b, KV_HEADS, sms)}" for b in batches) + ")")
    print("| --- | --- | --- | --- | --- | --- |")
    kv_bytes = 2 * context * KV_HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
    for batch in batches:
        default = triton_attention.decode_splits(batch, KV_HEADS, sms)
        variants = sorted({(max(1, default // 2), 64, 4), (default, 64, 4), (min(32, 2 * default), 64, 4),
                           (default, 128, 4), (default, 32, 4)})
        for splits, tile, warps in variants:
            seconds = attention_seconds(batch, context, layers, dtype, splits, tile, warps)
            print(f"| {batch} | {splits} | {tile} | {warps} | {1e6 * seconds:.2f} | "
                  f"{batch * kv_bytes / bandwidth / seconds:.0%} |")
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--attention-batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=36)
    args = parser.parse_args()
    dtype = torch.bfloat16
    bandwidth = measure_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"{torch.cuda.get_device_name()}: {bandwidth / 1e9:.0f} GB/s measured (copy)")
    with torch.inference_mode():
        if args.rows:
            matmul_table(args.rows, dtype, bandwidth)
        if args.attention_batches:
            attention_table(args.attention_batches, args.context, args.layers, dtype, bandwidth)


if __name__ == "__main__":
    main()
