"""KV memory of sliding-window models: bytes per token at long context, and how many long streams a KV
budget runs at once with the sliding layers in KV groups of their own (models/kv_groups.py) against
every layer kept for every token. The layout is the worker's (group_layers over the shape's layer
kinds, bf16 KV), the plan is memory.plan_kv_blocks and the scheduling is the real Scheduler's, driven
step by step by an executor that samples a fixed token: what it measures is memory, not speed.

    python benchmarks/sliding_window_kv.py                       # Gemma-3-4B and 12B, Gemma-4-E2B shapes
    python benchmarks/sliding_window_kv.py --kv-gib 2 --prompt 16000 --streams 32
"""

from __future__ import annotations

import argparse

from crane_mp.config import MemoryLimit
from crane_mp.models.kv_groups import FULL, group_layers, page_rows, sequence_blocks
from crane_mp.protocol import SamplingParams, StepResult
from crane_mp.scheduler.request import Request
from crane_mp.scheduler.scheduler import Scheduler, SchedulerConfig
from crane_mp.testing.make_zoo import PRESETS
from crane_mp.worker.cache.memory import plan_kv_blocks

BLOCK_SIZE = 16
CHUNK = 2048  # --max-num-batched-tokens' default


def layout(preset: str, grouped: bool) -> tuple[tuple[int, ...], int, int]:
    """(group windows, bytes per block id per token, bytes per token past the windows) of a preset."""
    shape = PRESETS[preset]
    kinds = shape["layer_types"][: shape["num_hidden_layers"] - shape.get("num_kv_shared_layers", 0)]
    windows = [shape["sliding_window"] if kind == "sliding_attention" else None for kind in kinds]
    shapes = [kv_shape(shape, kind == "sliding_attention") for kind in kinds]
    rows = [heads * size for heads, size in shapes]
    if not grouped:
        per_token = 2 * sum(rows) * 2  # K and V, bf16
        return (FULL,), per_token, per_token
    groups = group_layers(windows, shapes)
    per_token = 2 * sum(page_rows(groups, rows).values()) * 2
    return groups.windows, per_token, per_token * groups.windows.count(FULL)


def kv_shape(shape: dict, sliding: bool) -> tuple[int, int]:
    """(KV heads, head size) of a sliding or a global layer (Gemma 4's global ones have their own)."""
    if sliding:
        return shape["num_key_value_heads"], shape["head_dim"]
    return (shape.get("num_global_key_value_heads") or shape["num_key_value_heads"],
            shape.get("global_head_dim") or shape["head_dim"])


def most_streams(windows: tuple[int, ...], num_blocks: int, streams: int, prompt: int, output: int) -> tuple[int, int]:
    """(most streams decoding at once, preemptions) for `streams` requests of `prompt` + `output` tokens."""
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=streams,
                             max_num_batched_tokens=CHUNK, max_model_len=prompt + output, kv_windows=windows)
    sched = Scheduler(config)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(streams):
        sched.add_request(Request(i, [3 + (i * 7 + j) % 1000 for j in range(prompt)], params))
    most = 0
    while (plan := sched.schedule()) is not None:
        most = max(most, sum(s.num_new_tokens == 1 for s in plan.scheduled))
        done = [s.req_id for s in plan.scheduled
                if s.num_computed_tokens + s.num_new_tokens == sched.requests[s.req_id].num_tokens]
        sched.update(StepResult(plan.step_id, done, [5] * len(done)))
    return most, sched.num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gemma3-4b", "gemma3-12b", "gemma4-e2b"],
                        choices=sorted(PRESETS))
    parser.add_argument("--kv-gib", type=float, default=4.0, help="the KV cache's budget")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--streams", type=int, default=24)
    args = parser.parse_args()
    budget = int(args.kv_gib * 2**30)
    print(f"KV budget {args.kv_gib} GiB, {args.streams} streams of {args.prompt} + {args.output} tokens, "
          f"{BLOCK_SIZE}-token blocks, {CHUNK}-token steps")
    print("| shape | layout | KV groups | bytes/token at long context | blocks | streams at once | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for grouped in (False, True):
            windows, per_token, long_token = layout(preset, grouped)
            length = args.prompt + args.output
            plan = plan_kv_blocks(
                limit=MemoryLimit(budget + per_token * BLOCK_SIZE), total_bytes=1 << 40, weights_bytes=0,
                activation_bytes=0, kv_bytes_per_token=per_token, block_size=BLOCK_SIZE, max_model_len=length,
                max_num_seqs=args.streams, max_total_tokens=None,
                sequence_blocks=lambda n, w=windows: sequence_blocks(w, n, BLOCK_SIZE, CHUNK))
            most, preemptions = most_streams(windows, plan.num_blocks, args.streams, args.prompt, args.output)
            name = "sliding windows released" if grouped else "every layer global"
            print(f"| {preset} | {name} | {len(windows)} | {long_token} | {plan.num_blocks} | {most} | {preemptions} |")


if __name__ == "__main__":
    main()
