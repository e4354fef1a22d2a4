"""Registers, spills and shared memory of every Triton kernel of the CUDA path, for one model shape,
compiled for a GPU by Triton's own compiler and ptxas: no GPU needed.

    python benchmarks/triton_resources.py                        # Llama-3/Qwen3-8B shape, bf16, sm90
    python benchmarks/triton_resources.py --capability 86 --dtype float16 --heads 8 --kv-heads 2 --head-dim 64

A kernel that spills (stack bytes > 0) or needs more registers than leave the SM busy is where a GPU
profile would start. tests/unit/test_triton_compile.py keeps spills and shared memory in check.
"""

from __future__ import annotations

import argparse

import torch

from crane_mp.testing.triton_compile import (
    SHARED_MEMORY_LIMIT,
    attention_launches,
    compile_launch,
    elementwise_launches,
    gguf_launches,
    recorded_launches,
)

_SHOWN = ("NUM_SPLITS", "GROUP", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_K", "TILE", "QTYPE", "ADD_RESIDUAL",
          "NORM", "BLOCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, choices=sorted(SHARED_MEMORY_LIMIT))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    with recorded_launches() as launches:
        attention_launches(dtype, args.heads, args.kv_heads, args.head_dim)
        elementwise_launches(dtype, args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim)
        gguf_launches(dtype, args.hidden)
    print(f"sm{args.capability}, {args.dtype}, {args.heads} q / {args.kv_heads} kv heads of {args.head_dim}, "
          f"hidden {args.hidden}, MLP {args.intermediate}")
    print("| kernel | constants | warps | registers | stack bytes | shared KiB |")
    print("|---|---|---|---|---|---|")
    for launch in launches:
        built = compile_launch(launch, args.capability)
        constants = ", ".join(f"{k}={v}" for k, v in launch.kwargs.items() if k in _SHOWN)
        print(f"| {launch.name} | {constants} | {built.num_warps} | {built.registers} | {built.stack_bytes} | "
              f"{built.shared_bytes / 1024:.1f} |", flush=True)


if __name__ == "__main__":
    main()
