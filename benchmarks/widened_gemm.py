"""A float32 model's linear layers on a CPU without bf16 math, per row count: torch's linear on float32
weights (what a plain nn.Linear runs: MKL), oneDNN's packed float32 linear, and our widened kernel on
the same weights kept as bf16 (kernels/widened_linear.cpp).

    python benchmarks/widened_gemm.py                      # the small model's projections, 8 layers
    python benchmarks/widened_gemm.py --hidden 4096 --qkv 6144 --intermediate 12288 --layers 1   # 8B shape

The weights of every layer are distinct (as in a model, so they do not all sit in cache); each figure
also as the weight bytes the call reads per second (the bus's rate bounds decode-sized calls).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from crane_mp.worker.kernels.cpu_isa import kernel_isa, widened_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--qkv", type=int, default=768, help="fused q/k/v output width")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 128, 512])
    args = parser.parse_args()
    if not widened_linear():
        raise SystemExit(f"the widened kernel runs on the avx2 and avx512 tiers; this one is {kernel_isa()}")
    h = args.hidden
    shapes = [(h, args.qkv), (h, h), (h, 2 * args.intermediate), (args.intermediate, h)]  # (in, out)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16().float() for k, n in shapes] for _ in range(args.layers)]
    calls = {
        "torch": (weights, F.linear),
        "onednn": ([[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights],
                   lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
        "widened": ([[torch.ops.crane_mp.widened_pack_weight(w.bfloat16()) for w in layer] for layer in weights],
                    lambda x, w: torch.ops.crane_mp.widened_linear(x, w, None)),
    }
    flops_per_row = 2 * sum(k * n for k, n in shapes) * args.layers
    float32_bytes = 4 * sum(k * n for k, n in shapes) * args.layers
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k, _ in shapes}
        result = {"bench": "widened_gemm", "rows": rows, "threads": torch.get_num_threads()}
        for name, (layers, linear) in calls.items():
            def run(layers=layers, linear=linear, inputs=inputs) -> None:
                for layer in layers:
                    for (k, _), w in zip(shapes, layer):
                        linear(inputs[k], w)

            run()
            repeats = max(3, int(5e9 // (flops_per_row * rows)))
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            seconds = (time.perf_counter() - start) / repeats
            read = float32_bytes // 2 if name == "widened" else float32_bytes
            result[f"{name}_ms"] = round(seconds * 1e3, 2)
            result[f"{name}_gflops"] = round(flops_per_row * rows / seconds / 1e9, 1)
            result[f"{name}_weight_gbs"] = round(read / seconds / 1e9, 1)
        result["widened_vs_torch"] = round(result["torch_ms"] / result["widened_ms"], 2)
        result["widened_vs_onednn"] = round(result["onednn_ms"] / result["widened_ms"], 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
