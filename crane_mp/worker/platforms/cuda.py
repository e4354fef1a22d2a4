"""The CUDA platform: Triton kernels (elementwise, attention, GGUF dequantization) where Triton imports,
else torch ops; the memory plan is measured on the device and capped there."""

from __future__ import annotations

from typing import Any, Callable

import torch

from crane_mp.config import MemoryLimit, native_kernels_disabled
from crane_mp.worker.cache.memory import KVPlan
from crane_mp.worker.kernels import cpu_isa
from crane_mp.worker.platforms.base import DTYPES, Platform
from crane_mp.worker.quantized.matmul import TorchGGUF, TritonGGUF


def _triton_elementwise():
    if native_kernels_disabled():
        return None
    try:
        from crane_mp.worker.kernels import triton_elementwise
    except ImportError:
        return None
    return triton_elementwise


def _gguf_kernels() -> TorchGGUF:
    try:
        from crane_mp.worker.quantized import triton_dequant
    except ImportError:
        return TorchGGUF()
    return TritonGGUF(triton_dequant)


class CudaPlatform(Platform):
    name = "cuda"
    on_cpu = False
    pinned = True
    ordered_cumsum = False  # CUB's single-row scan groups its sums by thread
    reads_weights_in_place = False  # each tensor is read on its own and copied to the device
    default_memory_limit = MemoryLimit(fraction=0.9)  # most of the device, when no limit is given
    # Device memory outside torch's allocator that appears after the plan is made: Triton kernels
    # compiled for new shapes, cuBLAS handles of other streams, the decode graphs' executables.
    RUNTIME_GROWTH = 64 << 20

    def __init__(self, index: int) -> None:
        super().__init__(torch.device("cuda", index), _triton_elementwise(), _gguf_kernels())

    def label(self) -> str:
        return f"Cuda({self.device.index})"

    def describe(self) -> tuple[str, str]:
        """A CUDA worker never builds the CPU kernels: its kernel tier is "n/a"."""
        return cpu_isa.cpu_isa() or "below_avx2", "n/a"

    def compute_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        """16-bit weights are kept; float32 checkpoints run in bf16 (fp16 before Ampere)."""
        if requested != "auto":
            return DTYPES[requested]
        checkpoint = DTYPES.get(checkpoint_dtype or "", torch.float32)
        if checkpoint == torch.float32:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return checkpoint

    def kv_dtype(self, requested: str, compute: torch.dtype, keep_compute: bool = False) -> torch.dtype:
        """The CUDA kernels read the cache in the compute dtype: auto is that and nothing else is accepted."""
        name = str(compute).removeprefix("torch.")
        if requested not in ("auto", name):
            raise ValueError(f"--kv-cache-dtype {requested}: on CUDA the KV cache is kept in the compute dtype "
                             f"({name}); use auto")
        return compute

    def attention_backend(self, requested: str | None) -> str:
        if requested == "native":
            raise ValueError("the native attention kernel runs only on CPUs that build crane-mp's C++ kernels")
        return requested or "triton"

    def fused_qkv(self, head_dim: int) -> bool:
        return self.elementwise is not None and self.elementwise.supports_head_dim(head_dim)

    def tune_linears(self, model: torch.nn.Module, max_rows: int) -> list[str]:
        """16-bit linear layers: cuBLAS or the Triton matrix-vector kernels, whichever is faster for
        each shape and few-row count (skinny_linears.py); CRANE_MP_NO_NATIVE_KERNELS=1 keeps cuBLAS."""
        if self.elementwise is None:
            return []
        from crane_mp.worker.kernels import triton_skinny
        from crane_mp.worker.kernels.skinny_linears import tune_skinny_linears

        return tune_skinny_linears(model, triton_skinny, max_rows)

    def cuda_graphs(self, wanted: bool, attention_backend: str) -> bool:
        return wanted and attention_backend == "triton"

    def total_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def free_memory(self) -> int:
        """Free memory plus what torch's allocator holds unused."""
        torch.cuda.synchronize(self.device)
        return (torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
                - torch.cuda.memory_allocated(self.device))

    def allocated_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def runtime_bytes(self, activation_bytes: int) -> int:
        """What nvidia-smi will count besides the engine's tensors, measured once the weights are loaded
        and a full step has run (cuBLAS and Triton modules loaded): the CUDA context and libraries, which
        torch's allocator does not hold (with the device to itself, the whole device's use; another
        process's memory there is counted too, which only errs towards a smaller cache), plus the
        allocator's rounding of what it holds, plus the activations again (at least 384 MiB) for the
        fragmentation of steps' temporaries: an 8B Q4_K_M under 8G on an H200 left 237 MiB of its
        allocator's segments unusable, and a 2k-token prompt beside decodes took ~100 MiB more than
        the measured step."""
        torch.cuda.empty_cache()
        rounding = max(0, torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))
        return self._outside_allocator() + rounding + max(384 << 20, activation_bytes)

    def _outside_allocator(self) -> int:
        """Device memory in use that torch's allocator does not hold, and room for what will join it."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device)) + self.RUNTIME_GROWTH

    def enforce_limit(self, plan: KVPlan) -> None:
        """torch's allocator refuses to grow past the limit less what lives outside it (an allocation
        that would is a failed request, see runner.py, not memory taken from the host's other GPU
        users), so the process's device memory stays within the limit. For the worker process, which
        has the device to itself: the cap is process-wide."""
        cap = plan.limit_bytes - self._outside_allocator()
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, cap / self.total_memory())), self.device)

    def measure_activation_bytes(self, profile: Callable[[bool], int], estimate_bytes: int) -> int:
        """The allocator's peak."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        scratch = profile(True)
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before - scratch)
