"""Device-level choices made once at start-up: the platform, the KV cache's dtype and huge pages for large tensors."""

from __future__ import annotations

import os

import pytest
import torch

from crane_mp.worker.kernels.cpu_isa import native_bf16
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.platforms.device import prefer_huge_pages

CPU = platform_for("cpu")


def test_auto_kv_cache_on_cpu_is_16_bit_whatever_the_compute_dtype():
    sixteen = torch.bfloat16 if native_bf16() else torch.float16
    assert CPU.kv_dtype("auto", torch.float32) == sixteen
    assert CPU.kv_dtype("auto", torch.bfloat16) == sixteen


def test_an_embedding_model_keeps_its_compute_dtype_and_explicit_choices_win():
    assert CPU.kv_dtype("auto", torch.float32, keep_compute=True) == torch.float32
    assert CPU.kv_dtype("float32", torch.float32) == torch.float32
    assert CPU.kv_dtype("float16", torch.float32, keep_compute=True) == torch.float16


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("0", "0")])
def test_huge_pages_are_asked_for_unless_the_operator_said_otherwise(monkeypatch, preset, expected):
    if preset is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset)
    prefer_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == expected
