"""Qwen2.5-VL's multimodal rope: our positions against transformers' get_rope_index, and our composed
cos/sin tables against its rotary embedding, bit for bit; Qwen3-VL's interleaved sections too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel, Qwen2_5_VLRotaryEmbedding, rotate_half
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextRotaryEmbedding

from crane_mp.models.layouts import DecoderLayout
from crane_mp.mrope import mrope_positions
from crane_mp.worker.models.mrope_tables import mrope_columns, mrope_cos_sin
from crane_mp.worker.models.rope import apply_rope, rope_tables

IMAGE = 9
MERGE = 2


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def reference(request):
    if request.param == "qwen3_vl":  # the same positions for images (per-frame grids differ only for video)
        return Qwen3VLModel(Qwen3VLConfig(
            text_config={"vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
                         "num_key_value_heads": 1, "intermediate_size": 16, "head_dim": 16},
            vision_config={"depth": 1, "hidden_size": 8, "num_heads": 1, "intermediate_size": 8,
                           "out_hidden_size": 16, "num_position_embeddings": 4}, image_token_id=IMAGE))
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
                     "num_key_value_heads": 1, "intermediate_size": 16},
        vision_config={"depth": 1, "hidden_size": 8, "num_heads": 1, "intermediate_size": 8, "out_hidden_size": 16},
        image_token_id=IMAGE)
    return Qwen2_5_VLModel(config)


def _prompt(parts: list) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """parts: a number n (n text tokens) or an image's (t, h, w) grid, in prompt order."""
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, int):
            ids += [1 + i % 7 for i in range(part)]
        else:
            t, h, w = part
            images.append((len(ids), t, h, w))
            ids += [IMAGE] * (t * h * w // MERGE**2)
    return ids, images


@pytest.mark.parametrize("parts", [
    [5, (1, 4, 6), 7],
    [3, (1, 10, 4), 2, (1, 6, 6), 1, (1, 2, 14), 4],  # three images, text between and after
    [(1, 8, 8), 3],  # the prompt opens with an image
    [4, (1, 6, 10)],  # and ends with one
    [9],  # text only
])
def test_positions_and_delta_equal_get_rope_index(reference, parts):
    ids, images = _prompt(parts)
    positions, delta = mrope_positions(ids, images, MERGE)
    input_ids = torch.tensor([ids])
    grids = torch.tensor([[t, h, w] for _, t, h, w in images]) if images else None
    expected, deltas = reference.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=grids)
    assert positions.dtype == np.int64
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(deltas[0, 0])


def test_generated_tokens_continue_at_position_plus_delta():
    ids, images = _prompt([3, (1, 8, 12), 2])
    positions, delta = mrope_positions(ids, images, MERGE)
    # The text after the image resumes at 3 + max(8, 12) / 2 = 9: the prompt's last id is 10.
    assert positions[:, -1].tolist() == [10, 10, 10]
    assert len(ids) + delta == 11


def test_adjacent_images_each_take_their_own_grid():
    """transformers reads consecutive image tokens as one run, so it needs text between two images (the
    chat template always puts <|vision_end|><|vision_start|> there); ours are placed by their offsets."""
    ids, images = _prompt([2, (1, 2, 2), (1, 4, 2), 5])
    positions, _ = mrope_positions(ids, images, MERGE)
    assert positions[:, 2:5].T.tolist() == [[2, 2, 2], [3, 3, 3], [3, 4, 3]]
    assert positions[:, 5].tolist() == [5, 5, 5]


def test_overlapping_or_outside_images_are_refused():
    ids, _ = _prompt([20])
    with pytest.raises(ValueError):
        mrope_positions(ids, [(2, 1, 4, 4), (4, 1, 4, 4)], MERGE)
    with pytest.raises(ValueError):
        mrope_positions(ids, [(18, 1, 4, 4)], MERGE)


@pytest.mark.parametrize("head_dim,section", [(16, [2, 3, 3]), (128, [16, 24, 24])])
def test_composed_tables_equal_the_rotary_embedding(head_dim, section):
    heads, theta = 2, 1000000.0
    config = Qwen2_5_VLConfig(text_config={
        "hidden_size": head_dim * heads, "num_attention_heads": heads, "num_key_value_heads": 1,
        "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": theta}}).text_config
    num_tokens = 301
    positions = torch.randint(0, 8000, (3, num_tokens), generator=torch.Generator().manual_seed(0))
    ref_cos, ref_sin = Qwen2_5_VLRotaryEmbedding(config)(torch.zeros(1, num_tokens, 1), positions[:, None])
    ours = SimpleNamespace(rope_parameters=config.rope_parameters, head_dim=head_dim, rope_theta=theta,
                           layout=DecoderLayout(), hf_config=config)
    table_cos, table_sin = rope_tables(ours, 8192, torch.float32, torch.device("cpu"))
    cos, signed_sin = mrope_cos_sin(table_cos, table_sin, positions, mrope_columns(section))
    assert cos.shape == (num_tokens, 1, head_dim)
    assert torch.equal(cos[:, 0], ref_cos[0])
    q = torch.randn(num_tokens, heads, head_dim)
    q_embed = q * ref_cos[0, :, None] + rotate_half(q) * ref_sin[0, :, None]
    assert torch.equal(apply_rope(q, cos, signed_sin), q_embed)


def test_two_temporal_patches_equal_qwen2_5_vl():
    ids, images = _prompt([6, (2, 4, 6), 3])
    positions, delta = mrope_positions(ids, images, MERGE)
    model = Qwen2_5_VLModel(Qwen2_5_VLConfig(
        text_config={"vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
                     "num_key_value_heads": 1, "intermediate_size": 16},
        vision_config={"depth": 1, "hidden_size": 8, "num_heads": 1, "intermediate_size": 8, "out_hidden_size": 16},
        image_token_id=IMAGE))
    input_ids = torch.tensor([ids])
    grids = torch.tensor([[2, 4, 6]])
    expected, deltas = model.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=grids)
    assert positions.tolist() == expected[:, 0].tolist() and delta == int(deltas[0, 0])


@pytest.mark.parametrize("head_dim,rotary,section", [(32, 32, [6, 5, 5]), (128, 128, [24, 20, 20]),
                                                     (64, 32, [6, 5, 5])])  # Qwen3.5: rope on part of the head
def test_interleaved_sections_equal_qwen3_vl_rotary_embedding(head_dim, rotary, section):
    heads, theta = 2, 5000000.0
    params = {"rope_type": "default", "mrope_section": section, "rope_theta": theta, "mrope_interleaved": True}
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    config = Qwen3VLConfig(text_config={"hidden_size": 64, "num_attention_heads": heads, "head_dim": head_dim,
                                        "num_key_value_heads": 1, "rope_parameters": params}).text_config
    reference = Qwen3VLTextRotaryEmbedding(config)
    reference.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))  # Qwen3.5's
    num_tokens = 211
    positions = torch.randint(0, 8000, (3, num_tokens), generator=torch.Generator().manual_seed(0))
    ref_cos, ref_sin = reference(torch.zeros(1, num_tokens, 1), positions[:, None])
    ours = SimpleNamespace(rope_parameters=params, head_dim=head_dim, rope_theta=theta, hf_config=config,
                           layout=DecoderLayout(rotary_dim=rotary if rotary != head_dim else None))
    table_cos, table_sin = rope_tables(ours, 8192, torch.float32, torch.device("cpu"))
    cos, signed_sin = mrope_cos_sin(table_cos, table_sin, positions, mrope_columns(section, interleaved=True))
    assert cos.shape == (num_tokens, 1, rotary)
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(signed_sin[:, 0].abs(), ref_sin[0].abs())
    assert mrope_columns(section, interleaved=True)[: 3 * min(section)].tolist() == [0, 1, 2] * min(section)


def test_equal_positions_give_the_one_position_rows():
    """Text-only rows (all three ids equal) read the plain rope tables."""
    config = SimpleNamespace(rope_parameters={"rope_type": "default"}, head_dim=16, rope_theta=10000.0, hf_config=None,
                             layout=DecoderLayout())
    cos, signed_sin = rope_tables(config, 64, torch.float32, torch.device("cpu"))
    positions = torch.arange(40).expand(3, -1)
    mcos, msin = mrope_cos_sin(cos, signed_sin, positions, mrope_columns([2, 3, 3]))
    assert torch.equal(mcos[:, 0], cos[:40]) and torch.equal(msin[:, 0], signed_sin[:40])
