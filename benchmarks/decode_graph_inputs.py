"""Host time to stage one decode step's inputs for a replayed CUDA graph (DecodeGraphs._fill): ids,
positions, slots, context lengths and block tables written into the pinned buffer and copied. The GPU
waits for it every step, so it must stay far below a decode step (an 8B model's takes 5-15 ms on an H100).

    python benchmarks/decode_graph_inputs.py                   # batches 1 64 256, contexts 2k and 12k
    python benchmarks/decode_graph_inputs.py --batches 64 --contexts 2048
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.step.decode_graphs import DecodeGraphs, graph_batch_sizes

BLOCK_SIZE = 16


def fill_ms(batch: int, context: int, repeats: int) -> float:
    blocks = -(-(context + 1) // BLOCK_SIZE)
    runner = SimpleNamespace(attention_backend="triton", device=torch.device("cpu"), max_positions=context + 1,
                             block_size=BLOCK_SIZE, num_blocks=batch * blocks)
    graphs = DecodeGraphs(runner, graph_batch_sizes(256), capture=None)
    ids = random.sample(range(batch * blocks), batch * blocks)
    decodes = [SeqSpan(context, 1, ids[s * blocks : (s + 1) * blocks]) for s in range(batch)]
    tokens, positions = [1] * batch, [context] * batch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        graphs._fill(decodes, tokens, positions)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 12000])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print("| batch | context | ms per step |")
    print("| ---: | ---: | ---: |")
    for batch in args.batches:
        for context in args.contexts:
            print(f"| {batch} | {context} | {fill_ms(batch, context, args.repeats):.3f} |")


if __name__ == "__main__":
    main()
