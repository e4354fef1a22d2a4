"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket at start-up and
replayed each step, so a decode step costs a few host microseconds instead of hundreds of kernel launches.

A graph replays fixed kernels on fixed addresses, so every input of a decode forward lives in a static
device buffer: token ids, positions, context lengths, and per KV group (models/kv_groups.py) the KV
slots and block tables (one row per sequence, as wide as the longest sequence allowed). A step writes
them into one pinned host buffer, block tables only as wide as this batch's longest context, copies
that in one go, widens the tables on the device, pads the batch to its bucket and replays. Padded rows read and write only the KV cache's
spare block (see memory.py), so they never touch a live sequence. Attention must read block tables and
context lengths directly (the Triton and native kernels), not a per-step gathered copy.

Capture itself is a parameter: CUDA captures a torch.cuda.CUDAGraph; tests on CPU replay the same
forward eagerly over the same static buffers, which checks everything here but the capture.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from crane_mp.worker.cache.attention import AttentionMetadata, SeqSpan, group_spans
from crane_mp.worker.step.forward_context import ForwardContext, forward_context

log = logging.getLogger("crane_mp.worker")

_MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, then every multiple of 8 up to the largest batch (at most 256): a batch pads to the
    next bucket, wasting at most 7 rows of compute, which a memory-bound decode barely feels."""
    top = min(max_num_seqs, _MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sorted(set(sizes + [top]))


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None (run eagerly)."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class Captured:
    """A captured forward: replay() re-runs it and returns its output buffer."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_cuda(forward: Callable[[], torch.Tensor], pool) -> Captured:
    """Every graph is captured on one side stream, warmed up on it first: that compiles the Triton kernels
    and gives cuBLAS its workspace for the stream outside the graphs' pool (memory.py's slack counts it)."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream()
    stream = _capture_streams[device]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = forward()
    return Captured(graph, output)


def table_width(max_positions: int, block_size: int) -> int:
    """Block-table columns of the longest sequence allowed."""
    return -(-max_positions // block_size)


def static_buffer_bytes(max_batch: int, width: int, groups: int = 1) -> int:
    """Device memory of DecodeGraphs' static inputs: the staged copy (ids, positions, context lengths,
    and each KV group's slots and packed tables) and the widened block tables, all int64."""
    return ((3 + groups) * max_batch + 2 * groups * max_batch * width) * 8


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int], capture: Callable = capture_cuda) -> None:
        if runner.attention_backend == "torch":
            raise ValueError("decode graphs need an attention kernel that reads block tables (triton or native)")
        self.runner = runner
        self.sizes = sizes
        self._capture = capture
        device = runner.device
        max_batch = sizes[-1]
        self.width = table_width(runner.max_positions, runner.block_size)
        self.groups = len(runner.kv_groups.windows)
        # Per group: the first slot of the block past the scheduler's (memory.py), in the group's cache views.
        self.spare_slots = [runner.num_blocks * scale * runner.block_size for scale in runner.kv_groups.scales]
        # ids, positions, context lengths, each KV group's slots, then this step's block tables packed
        # [groups, count, widest]: one buffer, one copy per step; the tables are then widened on the
        # device into their static [groups, max_batch, width] buffer (a 32k-token model has 2k columns,
        # mostly unused).
        self._head = (3 + self.groups) * max_batch
        numel = self._head + self.groups * max_batch * self.width
        pinned = runner.platform.pinned
        self._host = torch.zeros(numel, dtype=torch.long, pin_memory=pinned)
        self._staged = torch.zeros(numel, dtype=torch.long, device=device)
        head = self._staged[: self._head].view(3 + self.groups, max_batch)
        self.ids, self.positions, self.ctx_lens, self.slots = head[0], head[1], head[2], head[3:]
        self.tables = torch.zeros(self.groups, max_batch, self.width, dtype=torch.long, device=device)
        # The pinned buffer is rewritten only once the GPU has copied it out (steps need not sync).
        self._copied = torch.cuda.Event() if pinned else None
        self.graphs: dict[int, Captured] = {}

    def capture_all(self) -> None:
        start = time.monotonic()
        platform = self.runner.platform
        before = platform.reserved_bytes()
        pool = platform.graph_pool()
        self._fill([], [], [])  # every row a padded one: captures read valid, harmless inputs
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self.graphs[size] = self._capture(lambda size=size: self._forward(size), pool)
        used = platform.reserved_bytes() - before
        log.info("captured decode graphs for %d batch sizes (%d..%d) in %.1f s, %.1f MiB",
                 len(self.sizes), self.sizes[0], self.sizes[-1], time.monotonic() - start, used / 2**20)

    def fits(self, batch: int) -> bool:
        return bucket_for(batch, self.sizes) is not None

    def run(self, decodes: list[SeqSpan], input_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Hidden states [len(decodes), hidden] of a decode-only step."""
        size = bucket_for(len(decodes), self.sizes)
        self._fill(decodes, input_ids, positions)
        return self.graphs[size].replay()[: len(decodes)]

    def _fill(self, decodes: list[SeqSpan], input_ids: list[int], positions: list[int]) -> None:
        """Padded rows write only the spare block's first slot; their block-table rows may hold stale
        block ids, which they only read from (their output is dropped)."""
        max_batch, block_size, groups = self.sizes[-1], self.runner.block_size, self.groups
        count = len(decodes)
        pad = max_batch - count
        spans = [decodes] + [group_spans(decodes, group) for group in range(1, groups)]
        slots = [slot for group, spare in zip(spans, self.spare_slots) for slot in
                 [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(group, positions)]
                 + [spare] * pad]
        used = [-(-(p + 1) // block_size) for p in positions]
        widest = max(used, default=0)
        if self._copied is not None:
            self._copied.synchronize()
        # Written through numpy, row by row: building a [count, widest] tensor from nested lists takes
        # 3 ms at 256 sequences of 2k tokens, longer than an 8B decode step on an H100; this takes 0.5 ms.
        host = self._host.numpy()
        host[: self._head] = (input_ids + [0] * pad + positions + [0] * pad + [p + 1 for p in positions]
                              + [1] * pad + slots)
        numel = self._head + groups * count * widest
        tables = host[self._head : numel].reshape(groups, count, widest)
        for group_tables, group in zip(tables, spans):
            for row, span, n in zip(group_tables, group, used):
                row[:n] = span.block_table[:n]
                row[n:] = 0
        self._staged[:numel].copy_(self._host[:numel], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if count:
            self.tables[:, :count, :widest].copy_(self._staged[self._head : numel].view(groups, count, widest))

    def _forward(self, size: int) -> torch.Tensor:
        runner = self.runner
        metas = [AttentionMetadata(
            slot_mapping=self.slots[group, :size], num_decode_tokens=size,
            decode_block_tables=self.tables[group, :size], decode_ctx_lens=self.ctx_lens[:size],
            prefill_token_index=None, prefill_valid_index=None, prefill_block_tables=None, num_prefills=0,
            max_prefill_q=0, prefill_is_fresh_single=False, backend=runner.attention_backend, dtype=runner.dtype,
            block_width=runner.block_size,
        ) for group in range(self.groups)]
        pos = self.positions[:size]
        ctx = ForwardContext(metas[0], runner.cos[pos].unsqueeze(1), runner.sin[pos].unsqueeze(1),
                             sliding_rope=runner.sliding_rope_rows(pos), group_attn=metas[1:])
        with forward_context(ctx):
            return runner.model(self.ids[:size])
