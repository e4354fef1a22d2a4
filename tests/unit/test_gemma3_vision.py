"""Gemma 3's SigLIP tower and projector against transformers' get_image_features (sdpa), float32, bit
for bit, under every checkpoint spelling of their names; and the model built on the meta device."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from crane_mp.worker.models.build import materialize
from crane_mp.worker.models.gemma3_vision import Gemma3Vision


@pytest.fixture(scope="module")
def reference():
    config = Gemma3Config(
        text_config={"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 64, "patch_size": 8, "vision_use_head": False},
        mm_tokens_per_image=16)
    config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # wider than the default init, so every op shows in the output
            param.normal_(0.0, 0.3)
    return model


def _vision_weights(model, spelling: str):
    """The vision side's tensors as transformers' state_dict (model.*), save_pretrained (no model.) or the
    released files (vision_tower.vision_model.*) name them."""
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        name = name.removeprefix("model.")
        if spelling == "released":
            name = name.replace("vision_tower.", "vision_tower.vision_model.")
        yield name, tensor


@pytest.mark.parametrize("spelling", ["saved", "released"])
def test_tower_and_projector_equal_transformers(reference, spelling):
    config = reference.config
    ours = Gemma3Vision(config.vision_config, 64, config.mm_tokens_per_image).eval()
    assert ours.load_weights(_vision_weights(reference, spelling)) == {name for name, _ in ours.named_parameters()}
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))  # an image and two crops
    with torch.no_grad():
        expected = reference.model.get_image_features(pixels).pooler_output
        out = ours(pixels)
    assert out.shape == (3 * 16, 64)
    assert torch.equal(out, expected.reshape(-1, 64)), (out - expected.reshape(-1, 64)).abs().max()


def test_built_on_meta_then_loaded_equals_transformers(reference):
    config = reference.config
    with torch.device("meta"):
        ours = Gemma3Vision(config.vision_config.to_dict(), 64, config.mm_tokens_per_image)
    materialize(ours, torch.device("cpu"))
    ours.load_weights(_vision_weights(reference, "saved"))
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours(pixels), reference.model.get_image_features(pixels).pooler_output[0])
