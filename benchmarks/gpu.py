"""Decode speed of the model runner against the memory roofline, on an 8B-shape random-weight model.

    python benchmarks/gpu.py                                  # Qwen3-8B shape, bf16, batches 1 8 64 256
    python benchmarks/gpu.py --batches 1 64 --context 2048 --no-cuda-graph
    python benchmarks/gpu.py --shape small --device cpu --batches 1 4 --context 64 --steps 4   # a smoke run

Each decode step reads every weight once and each sequence's KV cache once, so its floor is
(weight bytes + batch x context x KV bytes per token) / memory bandwidth, the bandwidth measured here
with a device-to-device copy. The runner is driven directly (forward, logits, greedy pick, the host
reading the ids), as the worker does per step, with the decode matmul kernels the worker would choose
at start-up; scheduler and HTTP costs are not in these numbers.
A batch whose KV cache would not fit runs at a shorter context, which the table shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config

from crane_mp.models.config import model_config_from_hf
from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.models.build import build_meta_model, materialize
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.step.decode_graphs import graph_batch_sizes
from crane_mp.worker.step.runner import ModelRunner
from crane_mp.worker.weights.loader import weight_bytes

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, vocab_size=8192, tie_word_embeddings=True),
}
BLOCK_SIZE = 16


def measure_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a large copy (read + write), best of five."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(shape: str, dtype: torch.dtype, device: torch.device, max_positions: int):
    hf_config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                            use_sliding_window=False)
    config = model_config_from_hf(hf_config)
    model = build_meta_model(config, dtype, platform_for(device))
    materialize(model, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    for attn in model.attention_layers():
        attn.finalize_weights()
    return model.eval(), config


def blocks_per_seq(context: int, steps: int) -> int:
    """KV blocks of a sequence through decode_seconds: its two warm-up steps write positions up to context + steps."""
    return -(-(context + steps + 1) // BLOCK_SIZE)


def decode_seconds(runner: ModelRunner, batch: int, context: int, steps: int, first_block: int) -> list[float]:
    """Seconds per decode step of `batch` sequences that each hold `context` keys, for `steps` steps."""
    per_seq = blocks_per_seq(context, steps)
    tables = [list(range(first_block + s * per_seq, first_block + (s + 1) * per_seq)) for s in range(batch)]
    ids = [1] * batch
    times = []
    for step in range(steps + 2):  # two warm-up steps
        positions = [context - 1 + step] * batch
        decodes = [SeqSpan(p, 1, table) for p, table in zip(positions, tables)]
        start = time.perf_counter()
        with torch.inference_mode():
            if runner.decode_graphs is not None and runner.decode_graphs.fits(batch):
                hidden = runner.decode_graphs.run(decodes, ids, positions)
            else:
                hidden = runner.forward(decodes, [], ids, positions, None)
            ids = runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return times


def profile_step(runner: ModelRunner, batch: int, context: int, steps: int) -> None:
    """Where a decode step's time goes: the graph's GPU time (CUDA events around its replay), the
    logits and greedy pick, the host's share of the wall time, then the kernels of eager steps."""
    per_seq = blocks_per_seq(context, steps)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    positions = [context - 1] * batch
    decodes = [SeqSpan(p, 1, table) for p, table in zip(positions, tables)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    graph_ms, head_ms, wall_ms = [], [], []
    with torch.inference_mode():
        for step in range(steps + 2):
            start = time.perf_counter()
            events[0].record()
            hidden = runner.decode_graphs.run(decodes, [1] * batch, positions)
            events[1].record()
            runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
            events[2].record()
            wall = time.perf_counter() - start
            torch.cuda.synchronize()
            if step >= 2:
                graph_ms.append(events[0].elapsed_time(events[1]))
                head_ms.append(events[1].elapsed_time(events[2]))
                wall_ms.append(1e3 * wall)
        print(f"batch {batch}: wall {statistics.median(wall_ms):.3f} ms = graph {statistics.median(graph_ms):.3f} "
              f"(GPU) + logits and pick {statistics.median(head_ms):.3f} (GPU) + the rest")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                hidden = runner.forward(decodes, [], [1] * batch, positions, None)
                runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=2048, help="keys per sequence when decoding starts")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--cublas-only", action="store_true",
                        help="keep cuBLAS for every projection (no start-up choice of decode matmul kernels)")
    parser.add_argument("--no-prologues", action="store_true",
                        help="keep each norm and SiLU*mul a kernel of its own (else folded in at batch 1)")
    parser.add_argument("--kv-fraction", type=float, default=0.8, help="of free memory after weights, for KV")
    parser.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    parser.add_argument("--profile", action="store_true",
                        help="then split the first batch's step: graph, logits, host; and its kernels eager")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    max_positions = args.context + args.steps + BLOCK_SIZE
    model, config = random_model(args.shape, dtype, device, max_positions)
    if args.no_prologues:
        for module in model.modules():
            module.__dict__.pop("prologue", None)
    if not args.cublas_only:
        for line in platform_for(device).tune_linears(model, max(args.batches)):
            print("decode matmul", line)
    runner = ModelRunner(model, BLOCK_SIZE, max_positions, platform_for(device))
    kv_per_token = runner.kv_bytes_per_token()
    wanted = max(args.batches) * blocks_per_seq(args.context, args.steps)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        fits = int(free * args.kv_fraction) // (kv_per_token * BLOCK_SIZE)
    else:
        fits = wanted
    runner.allocate_kv_cache(min(wanted, fits))
    graphs = device.type == "cuda" and not args.no_cuda_graph
    if graphs:
        runner.enable_decode_graphs(graph_batch_sizes(max(args.batches)))
    # Bytes every step reads whatever the batch: all weights but the embedding table, of which it reads
    # a row per sequence (a tied table is read whole, as the LM head).
    weights = weight_bytes(model)
    if not config.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}: {bandwidth / 1e9:.0f} GB/s measured; {args.shape} shape {args.dtype}, weights read per "
          f"step {weights / 2**30:.2f} GiB, KV {kv_per_token / 1024:.0f} KiB/token, graphs {'on' if graphs else 'off'}")
    print("| batch | context | tok/s | ITL p50 ms | ITL mean ms | roofline tok/s | of roofline |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in args.batches:
        context = min(args.context, runner.num_blocks // batch * BLOCK_SIZE - args.steps - 1)
        if context < 1:
            print(f"| {batch} | - | KV cache too small for this batch | | | | |")
            continue
        times = decode_seconds(runner, batch, context, args.steps, 0)
        mean = statistics.fmean(times)
        floor = (weights + batch * (context + args.steps / 2) * kv_per_token) / bandwidth
        print(f"| {batch} | {context} | {batch / mean:.0f} | {1e3 * statistics.median(times):.2f} | "
              f"{1e3 * mean:.2f} | {batch / floor:.0f} | {floor / mean:.0%} |")
    if args.profile and graphs:
        batch = args.batches[0]
        profile_step(runner, batch, min(args.context, runner.num_blocks // batch * BLOCK_SIZE - args.steps - 1),
                     args.steps)


if __name__ == "__main__":
    main()
