"""A mixture's experts in host memory beside a GPU (llama.cpp's --n-cpu-moe): when a GGUF model does not
fit its --gpu-memory-limit, the experts of its first mixture-of-experts layers stay in host memory and
run on the CPU's GGUF kernels (SparseMoE.host_experts: a step's rows go to the host and back), while
attention, routers, shared experts, dense layers and the KV cache stay on the GPU. A token reads a few
experts a layer, so the host streams a small share of those layers' weights per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from crane_mp.models.gguf_file import GGUFContents
from crane_mp.worker.platforms import Platform

_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias)$")
# What the GPU keeps beside the weights before anything is measured: the CUDA runtime and the allocator's
# slack (docs/cuda.md: ~700 MiB and at least 384 MiB), and room for the KV cache's first sequences.
GPU_RESERVE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class HostExperts:
    """The layers whose experts stay in host memory, and the CPU platform (and its 8-bit activation
    choice) that runs them."""

    layers: frozenset[int]
    platform: Platform
    int8: bool


def expert_bytes_by_layer(contents: GGUFContents) -> dict[int, int]:
    """Each layer's experts' bytes in the file (layers with experts only)."""
    layers: dict[int, int] = {}
    for name, info in contents.tensors.items():
        match = _EXPERTS.match(name)
        if match:
            layers[int(match[1])] = layers.get(int(match[1]), 0) + info.n_bytes
    return layers


def host_expert_layers(requested: int | None, expert_bytes: dict[int, int], total_bytes: int, budget: int) -> list[int]:
    """The layers whose experts stay in host memory, first layers first: the first `requested` layers
    with experts, or (None) as few as leave the rest of the file's `total_bytes` within `budget`."""
    layers = sorted(expert_bytes)
    if requested is not None:
        return layers[:requested]
    chosen: list[int] = []
    for layer in layers:
        if total_bytes - sum(expert_bytes[i] for i in chosen) <= budget:
            break
        chosen.append(layer)
    return chosen


def describe(layers: list[int], expert_bytes: dict[int, int]) -> str:
    """The start-up line's account of where the experts live."""
    if not layers:
        return "every layer's experts on the GPU"
    held = sum(expert_bytes[layer] for layer in layers) / 2**30
    span = f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else str(layers)
    return (f"experts of layers {span} ({len(layers)} of {len(expert_bytes)}) in host memory, {held:.1f} GiB, "
            f"on the CPU's kernels; the rest on the GPU")
