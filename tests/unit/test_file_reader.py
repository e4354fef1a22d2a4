"""The loader's two ways to a model file's bytes: read into memory of their own, or mapped for a
conversion that copies them anyway; nothing the model keeps may stay in the mapping."""

import ctypes
import mmap
import os

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


def resident_pages(path) -> np.ndarray:
    """mincore(2) of the whole file: 1 where a page is in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapping:
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        view = np.frombuffer(mapping, dtype=np.uint8)
        address = view.__array_interface__["data"][0]
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        del view
    return np.frombuffer(vec, dtype=np.uint8) & 1


def cached_file(path) -> None:
    """Leaves `path` whole in the page cache, or skips where this filesystem cannot drop its pages
    (tmpfs) or keep them."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # clean pages: the page cache may drop them
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if resident_pages(path).any():
        pytest.skip("this filesystem keeps file pages in memory (tmpfs)")
    path.read_bytes()
    if not resident_pages(path).all():
        pytest.skip("the file did not stay in the page cache after a read")


def test_released_bytes_leave_the_page_cache_and_read_back_from_the_file(data_file):
    path, data = data_file
    cached_file(path)
    mapped = MappedFile(path, [])
    try:
        mapped.view(0, 16)[:] = 0  # a copy-on-write page among those released
        mapped.release(3, 1 << 20)  # a page partly outside stays: its other bytes may be unread
        assert resident_pages(path)[0]
        mapped.release(0, 2 << 20)
        resident = resident_pages(path)
        assert not resident[: (2 << 20) // mmap.PAGESIZE].any() and resident[(2 << 20) // mmap.PAGESIZE :].all()
        assert np.array_equal(mapped.view(0, 1 << 20), data[: 1 << 20])  # the file's bytes, from disk
    finally:
        mapped.close()
