"""KV-cache sizing: how many blocks fit in the memory limit after weights and peak activations."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from crane_mp.config import MemoryLimit


_CPU_WARMUP_TOKENS = 128


class MemoryBudgetError(RuntimeError):
    """The memory limit cannot hold the weights plus one full-length sequence."""


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    limit_bytes: int
    weights_bytes: int
    activation_bytes: int


def device_total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return psutil.virtual_memory().total


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def plan_kv_blocks(
    *,
    limit: MemoryLimit | None,
    total_bytes: int,
    weights_bytes: int,
    activation_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_total_tokens: int | None,
) -> KVPlan:
    """Pure sizing rule. Without a limit (the CPU default) the KV cache may use a quarter of host RAM.

    The caller clamps max_model_len to max_total_tokens when that is set.

    Never more blocks than every running sequence could fill at full length: memory past that is waste.
    """
    if limit is not None:
        limit_bytes = limit.resolve(total_bytes)
    else:
        limit_bytes = int(0.25 * total_bytes) + weights_bytes
    budget = limit_bytes - weights_bytes - activation_bytes
    block_bytes = kv_bytes_per_token * block_size
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = max(0, budget // block_bytes)
    if num_blocks < blocks_per_seq:
        raise MemoryBudgetError(
            f"memory limit {_size(limit_bytes)} cannot hold the weights ({_size(weights_bytes)}), activations "
            f"({_size(activation_bytes)}) and the KV cache of one {max_model_len}-token sequence "
            f"({_size(blocks_per_seq * block_bytes)}); raise --gpu-memory-limit or lower --max-seq-len"
        )
    num_blocks = min(num_blocks, max_num_seqs * blocks_per_seq + 1)
    if max_total_tokens is not None:
        num_blocks = max(blocks_per_seq, min(num_blocks, max_total_tokens // block_size))
    return KVPlan(num_blocks, kv_bytes_per_token, num_blocks * block_bytes, limit_bytes, weights_bytes, activation_bytes)


def measure_activation_bytes(profile, num_tokens: int, device: torch.device, estimate_per_token: int) -> int:
    """Peak memory of `profile(num_tokens)` above what was allocated before it.

    CUDA reports its allocator's peak; CPU allocations are not tracked, so there we use the per-token
    estimate and run a short forward only as a warm-up (a full-budget one costs seconds of start-up).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        profile(num_tokens)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    profile(min(num_tokens, _CPU_WARMUP_TOKENS))
    return num_tokens * estimate_per_token
