"""Paged decode attention: the native CPU kernel against the portable torch path, same cache and shapes.

    python benchmarks/decode_attention.py --dtype float32
    CRANE_MP_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/decode_attention.py   # an AVX2-only host

Prints milliseconds per call (one layer) for the small benchmark model's heads.
"""

from __future__ import annotations

import argparse
import time

import torch

from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from crane_mp.worker.platforms import platform_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    blocks_per_seq = args.context // block
    cache_shape = (args.batch * blocks_per_seq, block, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype)
    q = torch.randn(args.batch, heads, head_dim).to(dtype)
    spans = [SeqSpan(args.context - 1, 1, list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)))
             for b in range(args.batch)]
    print(f"tiers (cpu, kernels): {platform_for('cpu').describe()}, torch capability {torch.backends.cpu.get_cpu_capability()}")
    for native in (False, True):
        meta = build_metadata(spans, [], block, torch.device("cpu"), dtype, "native" if native else "torch")
        for _ in range(20):
            paged_attention(q, None, None, k_cache, v_cache, meta, head_dim**-0.5)
        start = time.perf_counter()
        for _ in range(args.calls):
            paged_attention(q, None, None, k_cache, v_cache, meta, head_dim**-0.5)
        elapsed = (time.perf_counter() - start) / args.calls
        print(f"{'native kernel' if native else 'torch path':>13}: {elapsed * 1e3:.3f} ms per call")


if __name__ == "__main__":
    main()
