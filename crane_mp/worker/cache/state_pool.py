"""The state pool: a hybrid model's per-sequence recurrent state, beside the paged KV cache.

Each linear-attention layer (worker/models/gated_deltanet.py) keeps, per running sequence, a
convolution state in the compute dtype and a recurrent state (float32 by default: exactness depends
on it). Unlike KV, a sequence's state has a fixed size, so the pool is `slots` of them, one per
sequence the scheduler may run at once (the memory plan sizes it, cache/memory.py); a sequence takes
a slot when it first runs and gives it back when it finishes or is preempted (a preempted sequence
recomputes its prompt and tokens, as its KV does without the prefix cache).
"""

from __future__ import annotations

import math

import torch


def state_bytes_per_sequence(layers: list, conv_dtype: torch.dtype, recurrent_dtype: torch.dtype) -> int:
    """What one sequence's state takes over `layers` (GatedDeltaNet modules)."""
    total = 0
    for layer in layers:
        conv, recurrent = layer.state_shapes()
        total += math.prod(conv) * conv_dtype.itemsize + math.prod(recurrent) * recurrent_dtype.itemsize
    return total


class StatePool:
    def __init__(self, layers: list, slots: int, device: torch.device, conv_dtype: torch.dtype,
                 recurrent_dtype: torch.dtype) -> None:
        """Allocate `slots` sequences' state for every layer of `layers` and bind each layer's tensors."""
        self.layers = layers
        self.slots = slots
        for layer in layers:
            conv, recurrent = layer.state_shapes()
            layer.conv_state = torch.zeros((slots, *conv), dtype=conv_dtype, device=device)
            layer.recurrent_state = torch.zeros((slots, *recurrent), dtype=recurrent_dtype, device=device)
        self.bytes_per_sequence = state_bytes_per_sequence(layers, conv_dtype, recurrent_dtype)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"the state pool's {self.slots} slots are all held: the scheduler ran more "
                               "sequences at once than the memory plan gave state to")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """A sequence starting from its first token: no earlier inputs, an empty recurrent state."""
        for layer in self.layers:
            layer.conv_state[slot].zero_()
            layer.recurrent_state[slot].zero_()
