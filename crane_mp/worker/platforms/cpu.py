"""The CPU platform: our C++ kernels at the instruction-set tier this host allows (kernels/cpu_isa.py),
else portable torch ops."""

from __future__ import annotations

import logging
import math
import mmap
from typing import Callable

import psutil
import torch

from crane_mp.worker.kernels import cpu_isa
from crane_mp.worker.platforms.base import DTYPES, Platform
from crane_mp.worker.quantized.matmul import NativeGGUF, TorchGGUF

log = logging.getLogger(__name__)


class CpuPlatform(Platform):
    name = "cpu"
    on_cpu = True
    pinned = False
    ordered_cumsum = True
    reads_weights_in_place = True  # GGUF blocks are what the kernels read
    default_memory_limit = None

    def __init__(self) -> None:
        self.native = cpu_isa.kernel_isa() is not None  # builds or loads the kernels on first use
        super().__init__(torch.device("cpu"), torch.ops.crane_mp if self.native else None,
                         NativeGGUF() if self.native else TorchGGUF())

    def label(self) -> str:
        return "Cpu"

    def describe(self) -> tuple[str, str]:
        return cpu_isa.cpu_isa() or "below_avx2", cpu_isa.kernel_isa() or "portable"

    def compute_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        checkpoint = DTYPES.get(checkpoint_dtype or "", torch.float32)
        return cpu_isa.cpu_dtype(None if requested == "auto" else DTYPES[requested], checkpoint)

    def kv_dtype(self, requested: str, compute: torch.dtype, keep_compute: bool = False) -> torch.dtype:
        """auto is 16-bit whatever the compute dtype (bf16 where bf16 math is native, else float16, which
        F16C converts in one instruction): half the bytes of a float32 cache, so the same memory limit
        holds twice the context, and decode attention reads half the bytes. With `keep_compute` auto
        keeps the compute dtype, so the outputs equal the reference's at its precision: an embedding
        model reads its cache within one prompt and a Whisper window holds at most 448 positions (the
        bytes saved are few); a vision-language model's answers about an image move with 16-bit keys
        more than a text model's do (its random-weight tests flipped greedy tokens)."""
        if requested == "auto" and keep_compute:
            return compute
        if requested == "auto":
            return torch.bfloat16 if cpu_isa.native_bf16() else torch.float16
        return DTYPES[requested]

    def prompt_attention_dtype(self, compute: torch.dtype, kv: torch.dtype) -> torch.dtype | None:
        """bf16 for a float32 model whose cache holds bf16 keys anyway, on CPUs with AMX tiles or our
        AVX512-BF16 attention: torch's bf16 attention runs on the tiles, 3x its float32 attention (8B
        shape, 1,000 queries over 2,000 keys: 55 against 186 ms on a 2-core Sapphire Rapids), which a
        2,000-token prompt spent a sixth of its prefill in; without tiles it is no faster than float32,
        and our kernel takes the prompts instead (prompt_attention_kernel)."""
        if compute == torch.float32 and kv == torch.bfloat16 and (cpu_isa.cpu_isa() == "amx"
                                                                  or self.prompt_attention_kernel()):
            return torch.bfloat16
        return None

    def prompt_attention_kernel(self) -> bool:
        return cpu_isa.prompt_attention_kernel()

    def lora_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """float32 whatever the model's dtype: bf16 GEMMs this small run at half the speed."""
        return torch.float32

    def pack_bf16_weights(self, dtype: torch.dtype) -> bool:
        return cpu_isa.pack_bf16_weights(dtype)

    def attention_backend(self, requested: str | None) -> str:
        backend = requested or ("native" if self.native else "torch")
        if backend == "native" and not self.native:
            raise ValueError("the native attention kernel runs only on CPUs that build crane-mp's C++ kernels")
        return backend

    def int8_matmuls(self, quantized_activations: str) -> bool:
        return quantized_activations == "int8" and self.native

    def warm_kernel_caches(self, model: torch.nn.Module, max_rows: int) -> tuple[int, str]:
        """oneDNN's kernels for every row count the packed layers will be called with (cpu_packing.py),
        compiled now and measured as the resident memory they added."""
        from crane_mp.worker.weights.cpu_packing import warm_row_buckets

        before = psutil.Process().memory_info().rss
        shapes, calls = warm_row_buckets(model, max_rows)
        if not calls:
            return 0, ""
        return max(0, psutil.Process().memory_info().rss - before), f"{calls} oneDNN kernels ({shapes} weight shapes)"

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The native kernel is ~15x faster than torch's."""
        if self.native:
            return torch.ops.crane_mp.argmax_rows(x.contiguous())
        return x.argmax(dim=-1)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Anonymous memory the kernel hands out zeroed page by page as it is first touched: a large KV
        cache costs neither start-up time nor RAM until it is used. In 2 MiB pages where the kernel
        has them for the asking (transparent_hugepage=madvise): a decode step that reaches new blocks
        takes one fault where it took 512, and every step's reads cross fewer page boundaries."""
        num_bytes = math.prod(shape) * dtype.itemsize
        memory = mmap.mmap(-1, max(num_bytes, 1))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(memory, dtype=torch.uint8)[:num_bytes].view(dtype).view(shape)

    def total_memory(self) -> int:
        return psutil.virtual_memory().total

    def measure_activation_bytes(self, profile: Callable[[bool], int], estimate_bytes: int) -> int:
        """CPU allocations are not tracked: the estimate stands, and a small step, `profile(False)`,
        runs only as a warm-up (a full-budget one costs seconds of start-up)."""
        profile(False)
        return estimate_bytes
