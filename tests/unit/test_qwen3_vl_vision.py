"""Our Qwen3-VL vision tower (Qwen3.5's without deepstack) against transformers' (sdpa), float32, bit for
bit: its merged patches and each deepstack merger's, for images smaller and larger than the learned
position grid, several at once, two temporal patches; and built on the meta device as the loaders do."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3VLConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from crane_mp.worker.models.build import materialize
from crane_mp.worker.models.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

# A 6 x 6 learned position grid: images of 4 x 4 patches resample it down, 30 x 20 up.
_VISION = {"depth": 4, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 48,
           "num_position_embeddings": 36, "patch_size": 16}
PATCH_VALUES = 3 * 2 * 16 * 16


def _towers(family: str):
    if family == "qwen3_vl":
        config = Qwen3VLConfig(vision_config={**_VISION, "deepstack_visual_indexes": [0, 2]}).vision_config
        reference = Qwen3VLVisionModel
    else:
        config, reference = Qwen3_5Config(vision_config=_VISION).vision_config, Qwen3_5VisionModel
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = reference._from_config(config).eval()
    with torch.no_grad():
        for param in reference.parameters():  # wider than the default init, so every op shows in the output
            param.normal_(0.0, 0.3)
    ours = Qwen3VisionTower(config.to_dict()).eval()
    assert ours.load_weights(reference.state_dict().items()) == {name for name, _ in ours.named_parameters()}
    return reference, ours


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def towers(request):
    return _towers(request.param)


@pytest.mark.parametrize("grids", [
    [(1, 4, 4)],  # fewer patches than the position grid
    [(1, 30, 20)],  # more
    [(1, 10, 14), (1, 2, 8), (1, 6, 6)],  # three images at once
    [(2, 6, 4)],  # two temporal patches: attention per frame
])
def test_tower_equals_transformers(towers, grids):
    reference, ours = towers
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_VALUES, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(pixels, torch.tensor(grids))
        out = ours(pixels, grids)
    assert out.embeds.shape == (sum(t * h * w for t, h, w in grids) // 4, _VISION["out_hidden_size"])
    assert torch.equal(out.embeds, expected.pooler_output), (out.embeds - expected.pooler_output).abs().max()
    deepstack = getattr(expected, "deepstack_features", None) or []
    assert len(out.deepstack) == len(deepstack) == len(ours.cfg.deepstack_visual_indexes)
    assert all(torch.equal(a, b) for a, b in zip(out.deepstack, deepstack))


def test_rows_are_the_same_rows_of_every_layer():
    _, ours = _towers("qwen3_vl")
    pixels = torch.randn(32, PATCH_VALUES, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = ours(pixels, [(1, 4, 8)])
    part = whole.rows(1, 3)
    assert torch.equal(part.embeds, whole.embeds[1:3])
    assert all(torch.equal(a, b[1:3]) for a, b in zip(part.deepstack, whole.deepstack)) and len(part.deepstack) == 2


def test_tower_built_on_meta_then_loaded_equals_transformers():
    reference, _ = _towers("qwen3_vl")
    with torch.device("meta"):
        tower = Qwen3VisionTower(reference.config)
    materialize(tower, torch.device("cpu"))
    tower.load_weights(reference.state_dict().items())
    pixels = torch.randn(2 * 6 * 10, PATCH_VALUES, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(tower(pixels, [(1, 6, 10), (1, 6, 10)]).embeds,
                           reference(pixels, torch.tensor([(1, 6, 10), (1, 6, 10)])).pooler_output)


def test_config_from_a_hub_dict():
    """Qwen3-VL-8B's vision_config as config.json holds it; Qwen3.5's names no deepstack layers."""
    hub = {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
           "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
           "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
           "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    ours = Qwen3VisionConfig.of(hub)
    assert ours == Qwen3VisionConfig.of(Qwen3VLConfig(vision_config=hub).vision_config)
    assert ours.deepstack_visual_indexes == (8, 16, 24) and ours.head_dim == 72 and ours.rope_theta == 10000.0
    assert Qwen3VisionConfig.of({k: v for k, v in hub.items() if k != "deepstack_visual_indexes"}
                                ).deepstack_visual_indexes == ()


def test_fused_experts_are_read_in_either_layout():
    """Qwen3-VL-MoE's expert tensors as the released files hold them and as transformers 5 saves them
    (transposed) give the same stacked projections."""
    from crane_mp.worker.models.qwen3_vl import fused_experts

    experts, hidden, intermediate = 3, 8, 6
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=gen)  # transformers 5's layout
    down = torch.randn(experts, hidden, intermediate, generator=gen)
    prefix = "model.layers.0.mlp.experts."
    saved = dict(fused_experts([(prefix + "gate_up_proj", gate_up), (prefix + "down_proj", down),
                                ("model.norm.weight", torch.ones(hidden))], hidden, intermediate))
    released = dict(fused_experts([(prefix + "gate_up_proj", gate_up.transpose(1, 2).contiguous()),
                                   (prefix + "down_proj", down.transpose(1, 2).contiguous())], hidden, intermediate))
    assert set(saved) == {prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight",
                          "model.norm.weight"}
    assert torch.equal(saved[prefix + "gate_proj.weight"], gate_up[:, :intermediate])
    assert torch.equal(saved[prefix + "up_proj.weight"], gate_up[:, intermediate:])
    assert torch.equal(saved[prefix + "down_proj.weight"], down)
    assert all(torch.equal(released[name], saved[name]) for name in released)
