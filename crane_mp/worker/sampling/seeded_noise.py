"""Counter-based randomness for seeded requests: a pure function of (seed, output position).

Every seeded row of a batch gets its uniform from one set of integer ops, so a seeded request draws the
same tokens whatever else is batched with it, after preemption and resume too, with no per-row
generator call. The mixer is a 32-bit xorshift-multiply hash (the "lowbias32" family); its multipliers
are below 2**31 so every product of 32-bit lanes fits in int64 without overflow, on CPU and GPU alike.
"""

from __future__ import annotations

import torch

from crane_mp.worker.step.host_buffers import device_longs

_LOW32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """x: int64 values in [0, 2**32) -> a well-mixed value in the same range (a bijection)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _LOW32
    return x ^ (x >> 15)


def row_keys(seeds: list[int], positions: list[int], device: torch.device) -> torch.Tensor:
    """One 32-bit key per row from a signed 64-bit seed and the row's output position."""
    unsigned = [seed % (1 << 64) for seed in seeds]
    lanes = device_longs([u & _LOW32 for u in unsigned] + [u >> 32 for u in unsigned]
                         + [p & _LOW32 for p in positions], device).view(3, -1)
    lo, hi, pos = lanes
    return _mix32(_mix32(lo ^ _mix32(hi)) ^ pos)


def uniform_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in [0, 1) per key (24 random bits: every float32 step of the interval)."""
    return (_mix32(keys) >> 8).float() * 2.0**-24
