"""KV groups: how a model's attention layers share the blocks of the KV cache, so that sliding-window
layers keep only their window (vLLM's hybrid KV allocator is the model).

The layers are split into groups of equally many layers, each group of one attention kind (full, or
one window size). Every group has its own block table per sequence, drawn from the one shared block
pool; a block id holds `layers_per_group` layers' keys and values, and the i-th layer of every group
uses the i-th cache tensor. A full group's table grows with the sequence; a sliding group's blocks
wholly before the window of a sequence's next query go back to the pool. At long context a Gemma 3
(five sliding layers per global one) keeps one block per 16 tokens for its global group and a window's
worth for each sliding group, instead of every layer's keys for every token.

A model with one attention kind is one group of all its layers (the plain layout; a window then
still frees blocks, as for Mistral). Kinds of different KV shapes (Gemma 4's global layers have wider
heads) share one page size: a cache tensor keeps the widest kind's row per token, and a kind whose rows
are k times narrower views it as k times as many blocks, its block ids scaled by k (`scales`), so one
block id covers the same bytes in every group. Where a kind mixes shapes, or a narrower row does not
divide the widest, the model keeps the plain layout and its sliding layers' blocks stay held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FULL = 0  # a group's window when its layers attend to every earlier key


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: FULL, or the window in tokens
    layer_slots: tuple[tuple[int, int], ...]  # per attention layer: (group, index of its cache tensor)
    layers_per_group: int  # cache tensors: the i-th layer of every group uses tensor i
    # Per group: how many of its layers' blocks one block id's page holds, its ids' multiplier in their views.
    scales: tuple[int, ...] = (1,)


def group_layers(windows: list[int | None], shapes: list[tuple[int, ...]]) -> KVGroups:
    """Groups of the attention layers whose windows (None: full attention) and KV shapes (heads, head
    size) are given."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window or FULL, []).append(layer)
    kind_shapes = {window: {shapes[layer] for layer in layers} for window, layers in kinds.items()}
    rows = {window: math.prod(next(iter(found))) for window, found in kind_shapes.items()}
    widest = max(rows.values(), default=0)
    if len(kinds) <= 1 or any(len(found) > 1 for found in kind_shapes.values()) or any(
            widest % row for row in rows.values()):
        window = next(iter(kinds)) if len(kinds) == 1 else FULL
        return KVGroups((window,), tuple((0, layer) for layer in range(len(windows))), len(windows))
    per_group = min(len(layers) for layers in kinds.values())
    group_windows: list[int] = []
    slots: dict[int, tuple[int, int]] = {}
    for window in sorted(kinds):  # full attention first: group 0
        layers = kinds[window]
        for start in range(0, len(layers), per_group):
            for slot, layer in enumerate(layers[start : start + per_group]):
                slots[layer] = (len(group_windows), slot)
            group_windows.append(window)
    scales = tuple(widest // rows[window] for window in group_windows)
    return KVGroups(tuple(group_windows), tuple(slots[layer] for layer in range(len(windows))), per_group, scales)


def page_rows(groups: KVGroups, rows: list[int]) -> dict[int, int]:
    """Per cache tensor: the KV elements it keeps per token, the widest of the rows (heads x head size)
    of the attention layers using it, given per layer."""
    widest: dict[int, int] = {}
    for row, (_, slot) in zip(rows, groups.layer_slots):
        widest[slot] = max(widest.get(slot, 0), row)
    return widest


def first_live_block(window: int, first_query: int, block_size: int) -> int:
    """The first block a group still reads once its sequence's next query is at `first_query`."""
    return 0 if window == FULL else max(0, first_query - window + 1) // block_size


def sequence_blocks(windows: tuple[int, ...], num_tokens: int, block_size: int, chunk_tokens: int) -> int:
    """The most blocks one sequence of `num_tokens` holds at once over every group, computing at most
    `chunk_tokens` tokens a step: a sliding group holds the blocks of its window before the step's
    first query and those of the step's tokens."""
    total = -(-num_tokens // block_size)
    held = 0
    for window in windows:
        if window == FULL:
            held += total
        else:
            held += min(total, (window - 1 + chunk_tokens) // block_size + 2)
    return held
