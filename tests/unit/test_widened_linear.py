"""On CPUs without bf16 math a bf16 checkpoint computes in float32; its linear weights stay bf16 in memory
and our widened kernel multiplies them as float32: the float32 layer's products, summed in another order,
in half the memory. Weights that are not bf16 values keep torch's linear."""

from __future__ import annotations

import pytest
import torch

from crane_mp.models.config import load_model_config
from crane_mp.testing.make_model import make_model
from crane_mp.worker.kernels.cpu_isa import widened_linear
from crane_mp.worker.platforms.cpu import CpuPlatform
from crane_mp.worker.weights.cpu_packing import (
    PackedEmbedding,
    PackedLinear,
    pack_linear_weights,
)
from crane_mp.worker.weights.loader import weight_bytes
from tests.model_helpers import load_checkpoint, prefill_logits

pytestmark = pytest.mark.skipif(not widened_linear(), reason="this CPU tier has bf16 math: bf16 models compute in bf16")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 31, 32, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_linear_is_the_float32_product_of_the_bf16_weight(rows, bias):
    # in 8196 (4098 pairs): 5-31 rows walk K in two panels, 32 or more in nine; out 200: 25 blocks of 8
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 8196, generator=gen) / 50).bfloat16()
    b = torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 8196, generator=gen)
    packed = torch.ops.crane_mp.widened_pack_weight(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == weight.shape  # no copy besides it
    out = torch.ops.crane_mp.widened_linear(x, packed, b)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    products = x.abs().double() @ weight.abs().double().T
    assert ((out.double() - exact).abs() <= products * 2**-20 + 1e-6).all()  # float32 sums, in any order
    ids = torch.tensor([[0, 199], [8, 15], [77, 100]])  # a tied embedding reads rows back out of it
    assert torch.equal(torch.ops.crane_mp.widened_embedding(ids, packed), weight.float()[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.crane_mp.widened_embedding(torch.tensor([200]), packed)


def test_shapes_the_blocks_cannot_hold_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.crane_mp.widened_pack_weight(torch.zeros(12, 16, dtype=torch.bfloat16))
    packed = torch.ops.crane_mp.widened_pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crane_mp.widened_linear(torch.zeros(2, 16, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crane_mp.widened_linear(torch.zeros(2, 18), packed, None)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied head (read back by the embedding), untied with biases
def test_a_bf16_checkpoint_in_float32_keeps_bf16_weights_and_the_float32_logits(tmp_path, arch, monkeypatch):
    path = make_model(arch, "tiny", tmp_path / arch, dtype="bfloat16")
    config = load_model_config(path)
    widened = load_checkpoint(config, path, torch.float32)
    monkeypatch.setattr(CpuPlatform, "pack_bf16_weights", lambda self, dtype: False)
    plain = load_checkpoint(config, path, torch.float32)
    packed = [m for m in widened.modules() if isinstance(m, PackedLinear)]
    plain_linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    assert len(packed) == len(plain_linears) and all(m.widened for m in packed)
    assert isinstance(widened.model.embed_tokens, PackedEmbedding) == config.tie_word_embeddings
    linear_bytes = sum(m.weight.numel() * 4 for m in plain_linears)
    assert weight_bytes(widened) == weight_bytes(plain) - linear_bytes // 2  # bf16 where float32 was

    prompt = list(range(3, 40))
    ours, reference = (prefill_logits(model, prompt) for model in (widened, plain))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    top = ours.argmax(-1)
    margin = reference.max(-1).values - reference.gather(1, top[:, None]).squeeze(1)
    assert margin.max() < 1e-4  # the same greedy token but where the float32 model has a tie


def test_weights_that_are_not_bf16_values_keep_torch_s_linear(tmp_path):
    path = make_model("llama", "tiny", tmp_path / "l", dtype="float32")
    model = load_checkpoint(load_model_config(path), path, torch.float32)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16().float())
    layer = torch.nn.Sequential(linear)
    assert pack_linear_weights(layer) == 1 and layer[0].widened  # bf16 values, float32 bias
    for x in (torch.randn(3, 64), torch.randn(2, 5, 64)):  # rows of any leading shape
        torch.testing.assert_close(layer[0](x), linear(x), atol=1e-6, rtol=1e-5)
