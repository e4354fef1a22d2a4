"""oneDNN's packed bf16 GEMM against a packed float32 copy of the same bf16 weights, per row count, and
our AVX512-BF16 kernel (kernels/bf16_linear.cpp) where this CPU runs it (AVX512-BF16 without AMX).

    python benchmarks/cpu_gemm.py                      # the small model's projections, 8 layers
    python benchmarks/cpu_gemm.py --hidden 2560 --qkv 4096 --intermediate 10240 --layers 2   # Gemma-3-4B

The weights of every layer are distinct (as in a model, so they do not all sit in cache). This is the
measurement behind cpu_packing.WIDE_ROWS (from how many rows the float32 copy pays on this CPU) and
behind PackedLinear's choice of our kernel over oneDNN's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from crane_mp.worker.kernels.cpu_isa import amx_gemm, bf16_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--qkv", type=int, default=768, help="fused q/k/v output width")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 128, 512, 2048])
    args = parser.parse_args()
    h = args.hidden
    shapes = [(h, args.qkv), (h, h), (h, 2 * args.intermediate), (args.intermediate, h)]  # (in, out)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for k, n in shapes] for _ in range(args.layers)]
    packed = {
        "bf16": [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights],
        "float32": [[torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in layer] for layer in weights],
    }
    if bf16_linear() and not amx_gemm():
        packed["ours"] = [[torch.ops.crane_mp.bf16_pack_weight(w) for w in layer] for layer in weights]
    flops_per_row = 2 * sum(k * n for k, n in shapes) * args.layers
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k, _ in shapes}
        result = {"bench": "cpu_gemm", "rows": rows}
        for name, layers in packed.items():
            def run() -> None:
                for layer in layers:
                    for (k, _), w in zip(shapes, layer):
                        if name == "ours":
                            torch.ops.crane_mp.bf16_packed_linear(inputs[k], w, None)
                            continue
                        x = inputs[k] if name == "bf16" else inputs[k].float()
                        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                        if name == "float32":
                            out.bfloat16()

            run()
            repeats = max(3, int(2e10 // (flops_per_row * rows)))
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            seconds = (time.perf_counter() - start) / repeats
            result[f"{name}_ms"] = round(seconds * 1e3, 2)
            result[f"{name}_gflops"] = round(flops_per_row * rows / seconds / 1e9, 1)
        result["float32_speedup"] = round(result["bf16_ms"] / result["float32_ms"], 2)
        if "ours" in packed:
            result["ours_speedup"] = round(result["bf16_ms"] / result["ours_ms"], 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
