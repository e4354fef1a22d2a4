"""oneDNN is called with few row counts (cpu_packing.in_row_buckets) and its kernel caches are capped
(heap.cap_native_caches): a server's changing batch and chunk sizes would otherwise leave a compiled
kernel per row count in memory (issue 33)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from crane_mp.heap import NATIVE_CACHE_ENTRIES, cap_native_caches
from crane_mp.worker.weights.cpu_packing import PackedLinear, bucket_rows, in_row_buckets, row_buckets


def test_buckets_hold_every_row_count_with_little_padding():
    buckets = row_buckets()
    assert len(buckets) <= 27 and buckets == sorted({bucket_rows(r) for r in range(1, 257)})
    for rows in range(1, 257):
        padded = bucket_rows(rows)
        assert rows <= padded <= 256
        assert padded - rows <= (0 if rows <= 8 else 7 if rows <= 64 else 15)


def test_in_row_buckets_calls_only_bucket_sizes_and_returns_each_rows_own_result():
    def rowwise(x):  # a function of each row alone: padding and slabs must not show
        return torch.cat([x * 2, x.sum(dim=1, keepdim=True)], dim=1)

    calls = []
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, 8, 9, 63, 64, 65, 200, 256, 257, 700):
        x = torch.randn(rows, 6, generator=gen)
        out = in_row_buckets(x, lambda part: (calls.append(part.shape[0]), rowwise(part))[1])
        assert torch.equal(out, rowwise(x)), rows
    assert set(calls) <= set(row_buckets())
    assert calls[-3:] == [256, 256, 192]  # 700 rows: two slabs of 256, and 188 padded to 192


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")
def test_a_packed_linear_reaches_onednn_only_in_buckets_and_matches_f_linear():
    linear = torch.nn.Linear(64, 48, bias=True)  # float32 packs on any x86 tier (bf16 needs AVX-512)
    packed = PackedLinear(linear)
    seen = []
    original = packed._packed
    packed._packed = lambda x: (seen.append(x.shape[0]), original(x))[1]
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 300, 7):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert set(seen) <= set(row_buckets())
    assert len(set(seen)) < len(range(1, 300, 7))


def test_cache_caps_are_set_unless_the_operator_set_them(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")
    cap_native_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == NATIVE_CACHE_ENTRIES
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "4096"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")
def test_warming_calls_each_weight_shape_once_per_bucket_and_the_plan_hears_of_it():
    from crane_mp.worker.platforms.cpu import CpuPlatform
    from crane_mp.worker.weights.cpu_packing import warm_row_buckets

    model = torch.nn.ModuleList([PackedLinear(torch.nn.Linear(32, 16)), PackedLinear(torch.nn.Linear(32, 16)),
                                 PackedLinear(torch.nn.Linear(16, 32)), torch.nn.Linear(8, 8)])
    seen = []
    for layer in model[:3]:
        original = layer._packed
        layer._packed = lambda x, original=original: (seen.append(x.shape[0]), original(x))[1]
    buckets = row_buckets(40)
    assert warm_row_buckets(model, max_rows=40) == (2, 2 * len(buckets))
    assert sorted(seen) == sorted(buckets * 2)  # layers of one shape share oneDNN's kernels
    num_bytes, what = CpuPlatform().warm_kernel_caches(model, 40)
    assert num_bytes >= 0 and what == f"{2 * len(buckets)} oneDNN kernels (2 weight shapes)"
    assert CpuPlatform().warm_kernel_caches(torch.nn.Linear(4, 4), 40) == (0, "")
