"""The loader's two ways to a model file's bytes: read into memory of their own, or mapped for a
conversion that copies them anyway; nothing the model keeps may stay in the mapping."""

import numpy as np
import pytest
import torch

from crane_mp.worker.quantized.file_reader import MappedFile, read_ranges


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=(3 << 20) + 77, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_read_ranges_returns_each_range(data_file):
    path, data = data_file
    ranges = [(0, 10), (5, 2 << 20), (len(data) - 3, 3)]
    for (offset, length), got in zip(ranges, read_ranges(path, ranges)):
        assert np.array_equal(got, data[offset : offset + length])


def test_mapped_views_hold_the_file_bytes_and_copies_do_not(data_file):
    path, data = data_file
    mapped = MappedFile(path, [(0, len(data))])
    try:
        view = torch.from_numpy(mapped.view(1000, 4096))
        assert torch.equal(view, torch.from_numpy(data[1000:5096]))
        assert mapped.holds(view) and mapped.holds(view[7:])
        assert not mapped.holds(view.clone())
        with pytest.raises(EOFError):
            mapped.view(len(data) - 10, 11)
    finally:
        mapped.close()
    assert torch.equal(view[:5], torch.from_numpy(data[1000:1005]))  # the mapping outlives close() for its views


def test_a_view_written_to_leaves_the_file_alone(data_file):
    path, data = data_file
    mapped = MappedFile(path, [])
    try:
        mapped.view(0, 16)[:] = 0  # copy-on-write: what the loader does to permute rows in place
    finally:
        mapped.close()
    assert path.read_bytes()[:16] == data[:16].tobytes()
