"""Our Qwen2.5-VL vision tower against transformers' (sdpa), float32, bit for bit: one image or several,
grids smaller and larger than a window, tiles cut at the edges, two temporal patches."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from crane_mp.worker.models.build import materialize
from crane_mp.worker.models.qwen2_5_vl_vision import Qwen25VisionTower, VisionConfig, window_order

_VISION = {"depth": 4, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 48,
           "fullatt_block_indexes": [1, 3], "window_size": 112}


@pytest.fixture(scope="module")
def towers():
    config = Qwen2_5_VLConfig(vision_config=_VISION).vision_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    with torch.no_grad():
        for param in reference.parameters():  # wider than the default init, so every op shows in the output
            param.normal_(0.0, 0.3)
    ours = Qwen25VisionTower(config.to_dict()).eval()
    loaded = ours.load_weights(reference.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return reference, ours


@pytest.mark.parametrize("grids", [
    [(1, 4, 4)],  # one window
    [(1, 16, 16)],  # exactly 2 x 2 windows
    [(1, 10, 14)],  # tiles cut at the right and bottom edges
    [(1, 22, 6), (1, 4, 8), (1, 24, 24)],  # three images at once
    [(2, 12, 20)],  # two temporal patches: full attention per frame
])
def test_tower_equals_transformers(towers, grids):
    reference, ours = towers
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(pixels, torch.tensor(grids)).pooler_output
        out = ours(pixels, grids)
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, _VISION["out_hidden_size"])
    assert torch.equal(out, expected), f"max abs diff {(out - expected).abs().max().item()}"


def test_tower_built_on_meta_then_loaded_equals_transformers(towers):
    """As the loaders build models: nothing initialised, every value from the checkpoint."""
    reference, _ = towers
    with torch.device("meta"):
        tower = Qwen25VisionTower(reference.config)
    materialize(tower, torch.device("cpu"))
    tower.load_weights(reference.state_dict().items())
    pixels = torch.randn(2 * 6 * 10, 1176, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(tower(pixels, [(1, 6, 10), (1, 6, 10)]),
                           reference(pixels, torch.tensor([(1, 6, 10), (1, 6, 10)])).pooler_output)


def test_config_from_a_hub_dict_or_transformers():
    """Hub config.json files give vision_config without rope_parameters (and spell some keys their own way)."""
    hub = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
           "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
           "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}
    ours = VisionConfig.of(hub)
    assert ours == VisionConfig.of(Qwen2_5_VLConfig(vision_config=hub).vision_config)
    assert ours.rope_theta == 10000.0 and ours.head_dim == 80 and ours.fullatt_block_indexes == (7, 15, 23, 31)


def test_window_order_cuts_tiles_row_by_row():
    units, lengths = window_order([(1, 6, 6)], merge=2, window=2)  # a 3 x 3 grid of merged patches
    assert units.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert lengths == [16, 8, 8, 4]


def test_unknown_or_misshapen_tensors_are_refused(towers):
    _, ours = towers
    with pytest.raises(KeyError):
        ours.load_weights([("blocks.0.attn.qkv.scale", torch.zeros(1))])
    with pytest.raises(ValueError):
        ours.load_weights([("merger.ln_q.weight", torch.zeros(3))])
