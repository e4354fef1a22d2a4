"""What a worker asks of the device it runs on. One Platform per worker, chosen at start-up
(platforms/__init__.py), handed to the loaders, layers, runner, sampler and grammar engine as they are
built: they call it, and none of them tests the device again."""

from __future__ import annotations

from typing import Any, Callable

import torch

from crane_mp.config import MemoryLimit
from crane_mp.worker.cache.memory import KVPlan
from crane_mp.worker.quantized.matmul import TorchGGUF

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Platform:
    name: str  # "cpu" or "cuda", as WorkerReady reports it
    on_cpu: bool  # the scheduler paces prompts by measured time on CPU, and warms blocks first
    # Host staging buffers page-locked so that copies to the device run asynchronously.
    pinned: bool
    # CPU cumsum adds left to right, so a CDF is flat across zero-probability entries (sampler.py).
    ordered_cumsum: bool
    # Read a GGUF file whole into host memory the weights then live in (else tensor by tensor, copied out).
    reads_weights_in_place: bool
    default_memory_limit: MemoryLimit | None  # without --gpu-memory-limit

    def __init__(self, device: torch.device, elementwise: Any, gguf: TorchGGUF) -> None:
        self.device = device
        # Fused norms, SiLU*mul and q/k norm + rope + KV write, one contract on every device (the C++ ops,
        # the Triton module); None: torch ops.
        self.elementwise = elementwise
        self.gguf = gguf  # the quantized matmuls (quantized/matmul.py)

    def label(self) -> str:
        """crane-oai's spelling, reported by /model_info: Cuda(0) or Cpu."""
        raise NotImplementedError

    def describe(self) -> tuple[str, str]:
        """(CPU tier, kernel tier) as the start-up log and /server_info name them."""
        raise NotImplementedError

    # ---- dtypes ---------------------------------------------------------------------------------

    def compute_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        """--dtype (auto or a name) for a checkpoint stored in `checkpoint_dtype`."""
        raise NotImplementedError

    def kv_dtype(self, requested: str, compute: torch.dtype, keep_compute: bool = False) -> torch.dtype:
        """--kv-cache-dtype for a model computing in `compute`."""
        raise NotImplementedError

    def lora_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """LoRA matrices' dtype for a model in `dtype`."""
        return dtype

    def prompt_attention_dtype(self, compute: torch.dtype, kv: torch.dtype) -> torch.dtype | None:
        """The dtype long prompts' attention runs in when it is not `compute` (cache/attention.py); None:
        `compute`."""
        return None

    def prompt_attention_kernel(self) -> bool:
        """Long prompts' attention in prompt_attention_dtype runs in our own kernel
        (kernels/prompt_attention.cpp) rather than torch's."""
        return False

    def pack_bf16_weights(self, dtype: torch.dtype) -> bool:
        """Pack bf16 linear weights at load (cpu_packing.py)."""
        return False

    # ---- kernels --------------------------------------------------------------------------------

    def attention_backend(self, requested: str | None) -> str:
        """"native", "triton" or "torch": `requested` (a test's or CRANE_MP_ATTENTION's) or the default."""
        raise NotImplementedError

    def int8_matmuls(self, quantized_activations: str) -> bool:
        """GGUF matmuls on 8-bit activations (--quantized-activations int8 where the kernels take them)."""
        return False

    def fused_qkv(self, head_dim: int) -> bool:
        """q/k norm, rope and the KV-cache write run as one elementwise kernel for this head size."""
        return self.elementwise is not None

    def tune_linears(self, model: torch.nn.Module, max_rows: int) -> list[str]:
        """Pick each linear layer's decode-step kernel by timing it on the device; lines saying what won."""
        return []

    def warm_kernel_caches(self, model: torch.nn.Module, max_rows: int) -> tuple[int, str]:
        """Fill the kernel caches serving would grow, now: (bytes they hold, what they are), or (0, "")."""
        return 0, ""

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of a [N, V] float32 tensor."""
        return x.argmax(dim=-1)

    def cuda_graphs(self, wanted: bool, attention_backend: str) -> bool:
        """Capture decode steps as CUDA graphs (--cuda-graphs), which need an attention kernel that
        reads block tables itself."""
        return False

    # ---- memory ---------------------------------------------------------------------------------

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on the device (the KV cache)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def total_memory(self) -> int:
        raise NotImplementedError

    def free_memory(self) -> int | None:
        """Bytes the device can still hand out; None where the limit alone decides."""
        return None

    def allocated_bytes(self) -> int:
        """What torch has allocated on the device, where it tracks it (else 0)."""
        return 0

    def reserved_bytes(self) -> int:
        """What torch's caching allocator holds on the device (decode graphs' pool), else 0."""
        return 0

    def graph_pool(self) -> Any:
        """A memory pool decode graphs share, or None."""
        return None

    def runtime_bytes(self, activation_bytes: int) -> int:
        """Memory the limit must hold besides the engine's tensors (the memory plan's runtime_bytes)."""
        return 0

    def enforce_limit(self, plan: KVPlan) -> None:
        """Make the memory plan's limit hold at run time, where the allocator can be capped."""

    def measure_activation_bytes(self, profile: Callable[[bool], int], estimate_bytes: int) -> int:
        """Peak memory of the largest step, `profile(True)`, above what was allocated before it, less
        the bytes the profile returns (its scratch KV cache, live through the peak but not an
        activation)."""
        raise NotImplementedError
