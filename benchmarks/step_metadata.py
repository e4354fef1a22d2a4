"""Host time to build one eager step's attention inputs (attention.build_metadata: KV slots, padded
block tables, context lengths, packed into one buffer and copied). Every CPU step and every CUDA step
with a prefill chunk (CUDA graphs replay decode-only steps) waits for it.

    python benchmarks/step_metadata.py             # decodes at 2k and 12k contexts beside a 512-token chunk
    python benchmarks/step_metadata.py --decodes 32 --contexts 256 --chunk 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from crane_mp.worker.cache.attention import SeqSpan, build_metadata

BLOCK_SIZE = 16


def build_ms(decodes: int, context: int, chunk: int, backend: str, repeats: int) -> float:
    blocks = -(-(context + 1) // BLOCK_SIZE)
    chunk_blocks = -(-chunk // BLOCK_SIZE)
    ids = random.Random(0).sample(range(decodes * blocks + chunk_blocks), decodes * blocks + chunk_blocks)
    spans = [SeqSpan(context, 1, ids[s * blocks : (s + 1) * blocks]) for s in range(decodes)]
    prefills = [SeqSpan(0, chunk, ids[decodes * blocks :])] if chunk else []
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_metadata(spans, prefills, BLOCK_SIZE, torch.device("cpu"), torch.bfloat16, backend)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, nargs="+", default=[32, 64, 255])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 12000])
    parser.add_argument("--chunk", type=int, default=512, help="tokens of the one prefill chunk (0: none)")
    parser.add_argument("--backend", default="triton", choices=["torch", "native", "triton"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"| decodes | context | chunk | ms per step ({args.backend}) |")
    print("| ---: | ---: | ---: | ---: |")
    for decodes in args.decodes:
        for context in args.contexts:
            ms = build_ms(decodes, context, args.chunk, args.backend, args.repeats)
            print(f"| {decodes} | {context} | {args.chunk} | {ms:.3f} |")


if __name__ == "__main__":
    main()
