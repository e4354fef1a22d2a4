"""KV-cache sizing: how many blocks fit in the memory limit after weights, peak activations and the
memory set aside for decode graphs and sampler state.

On CUDA the limit bounds the device memory the worker process uses, as nvidia-smi shows it: the
plan counts what lives outside torch's allocator (the CUDA context, cuBLAS and Triton modules) and the
allocator's rounding besides the engine's tensors, and never counts on more than the device has free
after the weights are loaded (other processes), so a limit larger than what is free shrinks the cache
instead of running out of memory mid-serving. The device's own figures (total, free, peak) are the
platform's to measure (platforms/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from crane_mp.config import MemoryLimit


class MemoryBudgetError(RuntimeError):
    """The memory limit cannot hold the weights plus one full-length sequence."""


# With --max-seq-len unset, a model's own context that does not fit is lowered to what does, down to
# this many tokens (SGLang does the same; a Qwen3-8B at 40,960 tokens needs 5.6 GiB of KV for one
# sequence, more than an 8 GiB limit leaves beside its Q4_K_M weights). Below it, start-up fails.
MIN_FITTED_MODEL_LEN = 2048
# A hybrid model's state pool holds this many sequences where the budget allows (plan_kv_blocks).
STATE_SEQUENCES = 16


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    limit_bytes: int
    weights_bytes: int
    activation_bytes: int
    reserved_bytes: int = 0  # decode graphs (pool, inputs), oneDNN's kernel caches, other resident tensors
    runtime_bytes: int = 0  # outside the engine's tensors: CUDA context, libraries, allocator slack
    bound: str = "limit"  # what sized the cache: limit, free memory, max_num_seqs or max_total_tokens
    max_model_len: int = 0  # the longest sequence served: the caller's, or lowered to fit (fit_model_len)
    kv_bytes_per_long_token: int = 0  # what a token keeps past its sliding windows (models/kv_groups.py)
    # A hybrid model's state pool (cache/state_pool.py): sequences it holds state for, and one's bytes.
    state_slots: int = 0
    state_bytes_per_seq: int = 0

    def describe(self) -> str:
        runtime = f"CUDA runtime and allocator slack {_size(self.runtime_bytes)}, " if self.runtime_bytes else ""
        state = (f"state pool {_size(self.state_slots * self.state_bytes_per_seq)} ({self.state_slots} sequences of "
                 f"{_size(self.state_bytes_per_seq)}); " if self.state_slots else "")
        return (f"KV cache {_size(self.kv_budget_bytes)} ({self.num_blocks} blocks, bound by {self.bound}); {state}"
                f"weights {_size(self.weights_bytes)}, activations {_size(self.activation_bytes)}, "
                f"reserved {_size(self.reserved_bytes)}, {runtime}limit {_size(self.limit_bytes)}")


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
    reserved_bytes: int = 0,
    free_bytes: int | None = None,
    resident_bytes: int = 0,
    runtime_bytes: int = 0,
    fit_model_len: bool = False,
    sequence_blocks: Callable[[int], int] | None = None,
    kv_bytes_per_long_token: int = 0,
    state_bytes_per_seq: int = 0,
) -> KVPlan:
    """Pure sizing rule. Without a limit (the CPU default) the KV cache may use a quarter of host RAM.

    `free_bytes`: what the device can still hand out now, with the weights loaded (CUDA). One block
    beyond the plan's is always allocated: padded rows of a replayed decode graph write there.
    `reserved_bytes`: memory still to be allocated besides the KV cache (decode graphs).
    `resident_bytes`: memory already held besides the weights (rope tables, sampler and grammar
    tensors): counted against the limit, already missing from `free_bytes`.
    `runtime_bytes`: device memory the process uses besides its tensors (CUDA context, libraries, the
    allocator's rounding and fragmentation): counted against the limit only.

    The caller clamps max_model_len to max_total_tokens when that is set. With `fit_model_len` (the
    operator did not choose max_model_len), a max_model_len the budget cannot hold is lowered to what it
    can, down to MIN_FITTED_MODEL_LEN.

    Never more blocks than every running sequence could fill at full length: memory past that is waste.
    `sequence_blocks(n)`: the blocks a sequence of n tokens holds at most (KV groups whose sliding
    layers keep only their windows); by default one per `block_size` tokens.

    `state_bytes_per_seq`: a hybrid model's recurrent state per running sequence; the scheduler runs
    at most as many sequences at once as the state pool has slots. Of what the KV of one sequence
    leaves (of MIN_FITTED_MODEL_LEN tokens where max_model_len may still be lowered to fit, else of
    max_model_len), the pool takes room for STATE_SEQUENCES sequences where it holds them, else three
    quarters (at least one slot; at most max_num_seqs): concurrency first, then context, which the
    rest of the budget sizes as for any model.
    """
    if sequence_blocks is None:
        def sequence_blocks(num_tokens: int) -> int:
            return -(-num_tokens // block_size)
    if limit is not None:
        limit_bytes = limit.resolve(total_bytes)
    else:
        limit_bytes = int(0.25 * total_bytes) + weights_bytes
    block_bytes = kv_bytes_per_token * block_size
    budget = (limit_bytes - weights_bytes - resident_bytes - runtime_bytes - activation_bytes - reserved_bytes
              - block_bytes)
    bound = "limit"
    if free_bytes is not None and free_bytes - activation_bytes - reserved_bytes - block_bytes < budget:
        budget = free_bytes - activation_bytes - reserved_bytes - block_bytes
        bound = "free memory"
    blocks_per_seq = sequence_blocks(max_model_len)
    state_slots = 0
    if state_bytes_per_seq:
        shortest = min(max_model_len, MIN_FITTED_MODEL_LEN) if fit_model_len else max_model_len
        room = max(0, budget - sequence_blocks(shortest) * block_bytes)
        fits = room // state_bytes_per_seq
        state_slots = min(max_num_seqs, max(1, min(fits, max(STATE_SEQUENCES, room * 3 // 4 // state_bytes_per_seq))))
        budget -= state_slots * state_bytes_per_seq
        max_num_seqs = state_slots
    num_blocks = max(0, budget // block_bytes)
    fitted_len = _longest_sequence(num_blocks, max_model_len, block_size, sequence_blocks)
    if num_blocks < blocks_per_seq and fit_model_len and fitted_len >= min(max_model_len, MIN_FITTED_MODEL_LEN):
        max_model_len, blocks_per_seq = fitted_len, sequence_blocks(fitted_len)
    if num_blocks < blocks_per_seq:
        held = reserved_bytes + resident_bytes + runtime_bytes
        needs = (f"activations ({_size(activation_bytes)}), reserved memory ({_size(held)}), "
                 + (f"one sequence's recurrent state ({_size(state_bytes_per_seq)}) " if state_slots else "")
                 + f"and the KV cache of one {max_model_len}-token sequence ({_size(blocks_per_seq * block_bytes)})")
        if bound == "limit":
            raise MemoryBudgetError(f"memory limit {_size(limit_bytes)} cannot hold the weights "
                                    f"({_size(weights_bytes)}), {needs}; raise --gpu-memory-limit or lower --max-seq-len")
        raise MemoryBudgetError(f"free device memory ({_size(free_bytes)} once the weights are loaded; other "
                                f"processes hold the rest) cannot hold {needs}; free the device or lower --max-seq-len")
    if num_blocks > max_num_seqs * blocks_per_seq + 1:
        num_blocks, bound = max_num_seqs * blocks_per_seq + 1, "max_num_seqs"
    if max_total_tokens is not None and num_blocks > max(blocks_per_seq, max_total_tokens // block_size):
        num_blocks, bound = max(blocks_per_seq, max_total_tokens // block_size), "max_total_tokens"
    return KVPlan(num_blocks, kv_bytes_per_token, num_blocks * block_bytes, limit_bytes, weights_bytes,
                  activation_bytes, reserved_bytes + resident_bytes, runtime_bytes, bound, max_model_len,
                  kv_bytes_per_long_token or kv_bytes_per_token, state_slots, state_bytes_per_seq)


def _longest_sequence(num_blocks: int, limit: int, block_size: int, sequence_blocks: Callable[[int], int]) -> int:
    """The most tokens (a multiple of block_size, at most `limit`) one sequence may have in `num_blocks`."""
    low, high = 0, -(-limit // block_size)  # in blocks of tokens
    while low < high:
        mid = (low + high + 1) // 2
        if sequence_blocks(mid * block_size) <= num_blocks:
            low = mid
        else:
            high = mid - 1
    return min(limit, low * block_size)
