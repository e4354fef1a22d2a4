"""Pre-packed bf16 weights give the logits of plain weights, and replace them in memory.

oneDNN's packed weights give identical logits; the AMX kernel and our AVX512-BF16 kernel sum in a
different order, so their logits agree to bf16 rounding, and the greedy token differs only where the
plain model has a near tie."""

from __future__ import annotations

import pytest
import torch

from crane_mp.models.config import load_model_config
from crane_mp.testing.make_model import make_model
from crane_mp.worker.kernels.cpu_isa import amx_gemm, bf16_linear, pack_bf16_weights
from crane_mp.worker.platforms import platform_for
from crane_mp.worker.platforms.cpu import CpuPlatform
from crane_mp.worker.weights.cpu_packing import WIDE_ROWS, PackedEmbedding, PackedLinear, pack_linear_weights
from crane_mp.worker.weights.loader import weight_bytes
from tests.model_helpers import load_checkpoint, prefill_logits

pytestmark = pytest.mark.skipif(not pack_bf16_weights(torch.bfloat16), reason="this CPU tier packs no bf16 weights")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied head (stays plain) and untied head with biases
def test_packed_model_matches_plain_exactly(tmp_path, arch, monkeypatch):
    path = make_model(arch, "tiny", tmp_path / arch, dtype="bfloat16")
    config = load_model_config(path)
    packed = load_checkpoint(config, path, torch.bfloat16)
    monkeypatch.setattr(CpuPlatform, "pack_bf16_weights", lambda self, dtype: False)
    plain = load_checkpoint(config, path, torch.bfloat16)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert isinstance(packed.lm_head, PackedLinear)  # a tied head: in place for our kernels, else a packed copy
    head_in_place = (amx_gemm() or bf16_linear()) and config.tie_word_embeddings
    assert isinstance(packed.model.embed_tokens, PackedEmbedding) == head_in_place
    spare = [t for m in packed.modules() if isinstance(m, PackedLinear) for t in (m.wide_weight, m.wide_bias)
             if t is not None]
    if config.tie_word_embeddings and not head_in_place:
        spare.append(packed.lm_head.packed_weight)
    assert not (spare and amx_gemm())
    assert weight_bytes(packed) == weight_bytes(plain) + sum(t.numel() * t.element_size() for t in spare)

    outputs = [prefill_logits(model, list(range(3, 40))) for model in (packed, plain)]
    if amx_gemm() or bf16_linear():
        torch.testing.assert_close(outputs[0], outputs[1], atol=0.3, rtol=0.05)
        packed_top, plain_logits = outputs[0].argmax(-1), outputs[1]
        margin = plain_logits.max(-1).values - plain_logits.gather(1, packed_top[:, None]).squeeze(1)
        assert (margin == 0).float().mean() >= 0.9 and margin.max() < 0.3
    else:
        assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif(amx_gemm() or bf16_linear() or not pack_bf16_weights(torch.bfloat16),
                    reason="the float32 copy serves oneDNN-packed bf16 weights only")
@pytest.mark.parametrize("rows", [WIDE_ROWS - 1, WIDE_ROWS, 300])
def test_wide_float32_copy_computes_the_bf16_gemm(rows):
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen) / 10)
        linear.bias.copy_(torch.randn(160, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    packed = PackedLinear(linear, wide_float32=True)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    exact = (x.float() @ linear.weight.float().T + linear.bias.float()).to(torch.bfloat16)  # products exact in fp32
    if rows < WIDE_ROWS:
        assert torch.equal(out, torch.nn.functional.linear(x, linear.weight, linear.bias))
    ulp = exact.float().abs() * 2**-7 + 1e-6
    assert ((out.float() - exact.float()).abs() <= ulp).all()  # at most one bf16 rounding step apart


@pytest.mark.skipif(not bf16_linear() or amx_gemm(), reason="our AVX512-BF16 kernel serves CPUs without AMX")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_our_packed_bf16_linear_computes_the_bf16_product(rows, bias):
    # in 2624 (1312 pairs): more than 4 rows walk K in two blocks of 656 pairs
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(2624, 208, bias=bias).to(torch.bfloat16)  # 13 blocks of 16: 6, 6 and 1
    with torch.no_grad():
        linear.weight.copy_(torch.randn(208, 2624, generator=gen) / 50)
        if bias:
            linear.bias.copy_(torch.randn(208, generator=gen))
    packed = PackedLinear(linear)
    assert packed.ours and packed.packed_weight.shape == linear.weight.shape  # no copy besides it
    x = torch.randn(rows, 2624, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        products = x.float() @ linear.weight.float().T  # bf16 products are exact in float32
        exact = products + linear.bias.float() if bias else products
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 208)
    ulp = exact.abs() * 2**-8 + products.abs() * 2**-16 + 1e-6  # one rounding; float sums' order
    assert ((out.float() - exact).abs() <= ulp).all()
    ids = torch.tensor([[0, 207], [16, 31], [77, 200]])  # a tied embedding reads rows back out of it
    assert torch.equal(torch.ops.crane_mp.bf16_packed_embedding(ids, packed.packed_weight), linear.weight[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.crane_mp.bf16_packed_embedding(torch.tensor([208]), packed.packed_weight)


def test_pack_linear_weights_counts_modules(tmp_path):
    path = make_model("llama", "tiny", tmp_path / "l", dtype="bfloat16")
    config = load_model_config(path)
    from crane_mp.worker.models.build import build_model

    model = build_model(config, platform_for("cpu")).to(torch.bfloat16)
    layers = config.num_hidden_layers
    assert pack_linear_weights(model) == 4 * layers + 1  # qkv, o, gate_up, down per layer + untied head


@pytest.mark.skipif(not amx_gemm(), reason="no AMX")
@pytest.mark.parametrize("rows", [1, 17, 32, 45, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_float_reference(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen) / 10)
        if bias:
            linear.bias.copy_(torch.randn(160, generator=gen))
    linear = linear.to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    expected = torch.nn.functional.linear(
        x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
    )
    packed = PackedLinear(linear)
    assert packed.amx
    with torch.inference_mode():
        got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)  # one bf16 rounding
    ids = torch.tensor([0, 159, 16, 31, 77])
    assert torch.equal(torch.ops.crane_mp.amx_embedding(ids, packed.packed_weight), linear.weight[ids])


def test_shapes_amx_cannot_tile_fall_back_and_still_match(tmp_path):
    # vocab 500 and intermediate 120 are not multiples of 32: those layers (and the tied head with its
    # embedding) keep oneDNN or the plain layout, the rest may use AMX; greedy tokens are unchanged.
    # Without AMX the tied head (500 rows: not blocks of 16 for ours either) is a packed oneDNN copy.
    path = make_model("qwen3", "tiny", tmp_path / "odd", dtype="bfloat16",
                      overrides={"vocab_size": 500, "intermediate_size": 120})
    config = load_model_config(path)
    model = load_checkpoint(config, path, torch.bfloat16)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(model.lm_head, PackedLinear) == (not amx_gemm())  # AMX cannot tile it: stays plain
    mlp = model.model.layers[0].mlp
    assert not (mlp.gate_up_proj.amx or mlp.down_proj.amx)
    from crane_mp.config import EngineConfig
    from crane_mp.engine import LLMEngine
    from crane_mp.protocol import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="bfloat16", force_cpu=True, max_model_len=64))
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    together = engine.generate(prompts, params)
    assert [engine.generate([p], params)[0] for p in prompts] == together
    assert all(0 <= t < 500 for out in together for t in out)


@pytest.mark.skipif(not amx_gemm(), reason="no AMX")
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_packed_with_silu_returns_the_activation(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    inter, hidden = 48, 64
    linear = torch.nn.Linear(hidden, 2 * inter, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(2 * inter, hidden, generator=gen) / 4)
        if bias:
            linear.bias.copy_(torch.randn(2 * inter, generator=gen))
    linear = linear.to(torch.bfloat16)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    gate_up = torch.nn.functional.linear(
        x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
    )
    gate, up = gate_up.split(inter, dim=-1)
    packed = PackedLinear(linear, gate_up_silu=True)
    assert packed.silu_mul
    with torch.inference_mode():
        got = packed(x)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, atol=2e-2, rtol=1e-2)
