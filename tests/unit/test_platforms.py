"""The platform: chosen once per device, and the only thing layers, runner and sampler ask about it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from crane_mp.models.config import load_model_config
from crane_mp.models.gguf_file import ModelSource
from crane_mp.testing.make_model import make_model
from crane_mp.worker.kernels import cpu_isa
from crane_mp.worker.platforms import platform_for, select_platform
from crane_mp.worker.platforms.cpu import CpuPlatform
from crane_mp.worker.quantized.matmul import TorchGGUF
from crane_mp.worker.weights.loader import load_model
from tests.model_helpers import prefill_logits


def test_one_platform_per_device():
    cpu = platform_for("cpu")
    assert select_platform(force_cpu=True) is cpu
    assert platform_for(torch.device("cpu")) is cpu
    assert platform_for("cuda") is platform_for(torch.device("cuda", 0))
    assert platform_for("cuda").name == "cuda" and cpu.name == "cpu"
    with pytest.raises(ValueError, match="no platform"):
        platform_for("meta")


def test_cuda_keeps_its_cache_in_the_compute_dtype_and_has_no_cpu_kernels():
    cuda = platform_for("cuda")
    assert cuda.kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="use auto"):
        cuda.kv_dtype("float16", torch.bfloat16)
    assert cuda.attention_backend(None) == "triton" and cuda.attention_backend("torch") == "torch"
    with pytest.raises(ValueError, match="native attention"):
        cuda.attention_backend("native")
    assert not cuda.int8_matmuls("int8") and not cuda.pack_bf16_weights(torch.bfloat16)
    assert cuda.lora_dtype(torch.bfloat16) == torch.bfloat16 and platform_for("cpu").lora_dtype(torch.bfloat16) == torch.float32
    assert (cuda.label(), platform_for("cpu").label()) == ("Cuda(0)", "Cpu")


def test_the_cuda_limit_holds_what_lives_outside_torchs_allocator(monkeypatch):
    """As the H200 run measured it: 685 MiB of context and libraries on a 140 GiB device; the plan also
    keeps the allocator's rounding and fragmentation slack, and the allocator's cap leaves the context
    (and 64 MiB for kernels loaded later) inside the limit, as nvidia-smi counts it."""
    mib, gib = 1 << 20, 1 << 30
    total, reserved, allocated = 140 * gib, 6 * gib, 6 * gib - 80 * mib
    capped = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - reserved - 685 * mib, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: capped.append(fraction))
    cuda = platform_for("cuda")
    outside = 685 * mib + cuda.RUNTIME_GROWTH
    assert cuda.runtime_bytes(200 * mib) == outside + 80 * mib + 384 * mib
    assert cuda.runtime_bytes(1 * gib) == outside + 80 * mib + 1 * gib
    plan = type("Plan", (), {"limit_bytes": 8 * gib})()
    cuda.enforce_limit(plan)
    assert capped == [pytest.approx((8 * gib - outside) / total)]


def test_without_native_kernels_the_cpu_platform_hands_out_torch_ops(monkeypatch):
    monkeypatch.setattr(cpu_isa, "kernel_isa", lambda: None)
    portable = CpuPlatform()
    assert portable.elementwise is None and type(portable.gguf) is TorchGGUF
    assert not portable.fused_qkv(128) and not portable.int8_matmuls("int8")
    assert portable.attention_backend(None) == "torch"
    with pytest.raises(ValueError, match="native attention"):
        portable.attention_backend("native")
    assert portable.describe()[1] == "portable"
    assert portable.argmax_rows(torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 5.0]])).tolist() == [1, 0]


class RecordingOps:
    """Elementwise kernels in torch ops that count their calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm_(self, x, residual, weight, eps):
        self.calls["add_rms_norm_"] += 1
        residual.add_(x)
        x.copy_(F.rms_norm(residual, (x.shape[-1],), weight, eps))

    def silu_and_mul(self, gate_up):
        self.calls["silu_and_mul"] += 1
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class RecordingPlatform(CpuPlatform):
    def __init__(self, ops: RecordingOps) -> None:
        super().__init__()
        self.elementwise = ops

    def fused_qkv(self, head_dim: int) -> bool:
        return False


def test_layers_call_the_kernels_their_platform_handed_them(tmp_path):
    path = make_model("qwen3", "tiny", tmp_path / "q", dtype="float32", seed=3)
    config = load_model_config(path)
    ops = RecordingOps()

    def logits(platform):
        model, _ = load_model(config, ModelSource("safetensors", Path(path)), torch.float32, platform, progress=False)
        return prefill_logits(model, list(range(3, 30)))

    recorded = logits(RecordingPlatform(ops))
    layers = config.num_hidden_layers
    # Each layer: two norms (the first of the first layer has no residual yet), one SiLU*mul; then the final norm.
    assert ops.calls == Counter(rms_norm=2, add_rms_norm_=2 * layers - 1, silu_and_mul=layers)
    torch.testing.assert_close(recorded, logits(platform_for("cpu")), rtol=1e-4, atol=1e-4)


class _Float16Device:
    """A device whose automatic dtype is float16 (a GPU without bf16)."""

    def compute_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        return torch.float16 if requested in ("auto", "float16") else getattr(torch, requested)


def test_gemma_never_runs_in_an_automatic_float16(caplog):
    from crane_mp.models.config import model_config_from_hf
    from crane_mp.testing.make_zoo import build_zoo_config
    from crane_mp.worker.bootstrap import model_dtype

    gemma = model_config_from_hf(build_zoo_config("gemma3_text"))
    olmo = model_config_from_hf(build_zoo_config("olmo2"))
    assert model_dtype(_Float16Device(), "auto", gemma) == torch.float32
    assert model_dtype(_Float16Device(), "auto", olmo) == torch.float16
    assert model_dtype(_Float16Device(), "float16", gemma) == torch.float16  # asked for: served, with a warning
    assert "overflow float16" in caplog.text
    assert model_dtype(_Float16Device(), "bfloat16", gemma) == torch.bfloat16
