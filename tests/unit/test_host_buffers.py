"""Step inputs reach a non-CPU device through pinned host memory, from lists and numpy arrays alike.

A CPU-only torch has no pinned allocator, so pinning is recorded instead, and the "meta" device stands
in for CUDA: the code under test takes the same branch it takes on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crane_mp.worker.step.host_buffers import device_bools, device_floats, device_longs, device_tensor


@pytest.fixture
def pinned(monkeypatch):
    copies: list[torch.Tensor] = []

    def pin_memory(self):
        copies.append(self.clone())
        return copies[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return copies


@pytest.mark.parametrize("values", [[3, 1, 4, 1, 5], np.array([3, 1, 4, 1, 5], dtype=np.int32),
                                    np.array([3, 1, 4, 1, 5], dtype=np.int64)])
def test_a_device_tensor_is_staged_in_pinned_memory_from_a_list_or_an_array(pinned, values):
    out = device_longs(values, torch.device("meta"))
    assert out.device.type == "meta" and out.dtype == torch.long and out.shape == (5,)
    assert len(pinned) == 1
    assert pinned[0].dtype == torch.long and pinned[0].tolist() == [3, 1, 4, 1, 5]


def test_the_pinned_copy_does_not_alias_the_callers_array(pinned):
    values = np.arange(4, dtype=np.int64)
    device_longs(values, torch.device("meta"))
    values[:] = -1
    assert pinned[0].tolist() == [0, 1, 2, 3]


def test_floats_and_bools_take_the_same_path(pinned):
    device_floats([0.5, 2.0], torch.device("meta"))
    device_bools([True, False], torch.device("meta"))
    assert [t.dtype for t in pinned] == [torch.float32, torch.bool]
    assert pinned[0].tolist() == [0.5, 2.0] and pinned[1].tolist() == [True, False]


def test_on_cpu_nothing_is_pinned_and_an_array_of_the_dtype_is_shared(pinned):
    values = np.arange(3, dtype=np.int64)
    out = device_tensor(values, torch.long, torch.device("cpu"))
    assert not pinned
    values[0] = 7
    assert out.tolist() == [7, 1, 2]
