"""A mixture's experts on CUDA, one layer at a 30B-A3B shape in bf16: the grouped matmuls over pairs sorted
on the device (kernels/triton_moe.py) against one cuBLAS matmul an expert (the host groups the pairs),
per decode batch size, with the bytes of the experts a step reads over the device's copy bandwidth.

    python benchmarks/gpu_experts.py [--batches 1 8 64 256] [--steps 50]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gpu import measure_bandwidth

from crane_mp.models.layouts import ExpertLayout
from crane_mp.worker.kernels import triton_elementwise, triton_moe
from crane_mp.worker.models.moe import Experts


def timed_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args(argv)
    layout = ExpertLayout(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.width)
    experts = Experts(args.experts, args.hidden, args.width, F.silu, triton_elementwise, layout)
    experts = experts.to("cuda", torch.bfloat16)
    bandwidth = measure_bandwidth(torch.device("cuda"), 2**30)
    expert_bytes = 3 * args.hidden * args.width * 2
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth / 1e9:.0f} GB/s; one expert {expert_bytes / 2**20:.1f} MiB")
    print("| batch | experts read | grouped ms | per-expert ms | grouped of roofline |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for batch in args.batches:
        x = torch.randn(batch, args.hidden, generator=gen).to("cuda", torch.bfloat16)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in range(batch)]).cuda()
        weights = torch.rand(batch, args.top_k, generator=gen).cuda().to(torch.bfloat16)
        read = len(set(ids.reshape(-1).tolist()))
        grouped = timed_ms(lambda: experts._grouped_forward(x, ids, weights), args.steps)
        experts.grouped = None
        plain = timed_ms(lambda: experts(x, ids, weights), args.steps)
        experts.grouped = triton_moe
        roofline = read * expert_bytes / bandwidth * 1e3 / grouped
        print(f"| {batch} | {read} | {grouped:.3f} | {plain:.3f} | {roofline:.0%} |")


if __name__ == "__main__":
    main()
