"""Pre-packed bf16 weights give exactly the logits of plain weights, and replace them in memory."""

from __future__ import annotations

import pytest
import torch

from crane_mp.testing.make_model import make_model
from crane_mp.worker.attention import SeqSpan, build_metadata
from crane_mp.worker.cpu_packing import PackedLinear, can_pack, pack_linear_weights
from crane_mp.worker.forward_context import ForwardContext, forward_context
from crane_mp.worker.loader import load_model, weight_bytes
from crane_mp.worker.model_config import load_model_config
from crane_mp.worker.runner import ModelRunner

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="oneDNN unavailable")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied head (stays plain) and untied head with biases
def test_packed_model_matches_plain_exactly(tmp_path, arch, monkeypatch):
    path = make_model(arch, "tiny", tmp_path / arch, dtype="bfloat16")
    config = load_model_config(path)
    packed = load_model(config, path, torch.bfloat16, CPU, progress=False)
    monkeypatch.setattr("crane_mp.worker.loader.can_pack", lambda dtype, device: False)
    plain = load_model(config, path, torch.bfloat16, CPU, progress=False)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert isinstance(packed.lm_head, PackedLinear) == (not config.tie_word_embeddings)
    assert weight_bytes(packed) == weight_bytes(plain)

    prompt = list(range(3, 40))
    outputs = []
    for model in (packed, plain):
        runner = ModelRunner(model, 16, 64, CPU)
        runner.allocate_kv_cache(4)
        meta = build_metadata([], [SeqSpan(0, len(prompt), [0, 1, 2])], 16, CPU, torch.bfloat16)
        pos = torch.arange(len(prompt))
        with torch.inference_mode(), forward_context(ForwardContext(meta, runner.cos[pos, None], runner.sin[pos, None])):
            outputs.append(model.compute_logits(model(torch.tensor(prompt))))
    assert torch.equal(outputs[0], outputs[1])


def test_pack_linear_weights_counts_modules(tmp_path):
    path = make_model("llama", "tiny", tmp_path / "l", dtype="bfloat16")
    config = load_model_config(path)
    from crane_mp.worker.models import build_model

    model = build_model(config).to(torch.bfloat16)
    layers = config.num_hidden_layers
    assert pack_linear_weights(model) == 4 * layers + 1  # qkv, o, gate_up, down per layer + untied head
