"""What oneDNN keeps per row count: resident memory after calling packed linear layers with every row
count from 1 to --rows, as they were called before issue 33 (each call as it comes, default caches)
and as the worker calls them now (row counts bucketed, caches capped; cpu_packing.py, heap.py).

    python benchmarks/onednn_row_counts.py            # both, each in a fresh process
    python benchmarks/onednn_row_counts.py --mode raw

Float32 weights, which oneDNN packs on any x86 tier; the worker's oneDNN path is bf16 on AVX-512
CPUs without AMX, with the same per-row-count caching.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import psutil
import torch

from crane_mp.heap import cap_native_caches
from crane_mp.worker.weights.cpu_packing import PackedLinear

HIDDEN = 512
OUT_FEATURES = (1536, 512, 3072, 2048, 8192)  # a small model's qkv, o, gate_up, down, LM head


def grown_mib(mode: str, rows: int) -> int:
    if mode == "bucketed":
        cap_native_caches()
    layers = [PackedLinear(torch.nn.Linear(HIDDEN, n)) for n in OUT_FEATURES]
    call = (lambda layer, x: layer(x)) if mode == "bucketed" else (lambda layer, x: layer._packed(x))
    proc = psutil.Process()
    start = proc.memory_info().rss
    for m in range(1, rows + 1):
        x = torch.randn(m, HIDDEN)
        for layer in layers:
            call(layer, x)
    return (proc.memory_info().rss - start) >> 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["raw", "bucketed"], help="one mode, in this process")
    parser.add_argument("--rows", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.mode:
        print(f"{args.mode}: +{grown_mib(args.mode, args.rows)} MiB resident after row counts 1-{args.rows} "
              f"through {len(OUT_FEATURES)} packed weights")
        return
    for mode in ("raw", "bucketed"):  # fresh processes: the caches are per process
        subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(args.rows)], check=True)


if __name__ == "__main__":
    main()
