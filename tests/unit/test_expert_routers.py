"""Each family's router against transformers' own router module on the same logits: the experts a
token picks and their weights (DeepSeek's group-limited choices, V3's sigmoid with its correction
bias, gpt-oss's softmax over the top logits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from crane_mp.models.layouts import decoder_layout
from crane_mp.worker.models.moe import route

EXPERTS, HIDDEN = 16, 32


def _config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
                                num_experts_per_tok=3, **fields)


CASES = {
    "deepseek_v2 greedy": ("deepseek_v2", DeepseekV2TopkRouter, {"n_routed_experts": EXPERTS, "topk_method": "greedy",
                                                                 "routed_scaling_factor": 1.5}),
    "deepseek_v2 group-limited": ("deepseek_v2", DeepseekV2TopkRouter, {
        "n_routed_experts": EXPERTS, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    "deepseek_v3": ("deepseek_v3", DeepseekV3TopkRouter, {"n_routed_experts": EXPERTS, "n_group": 4, "topk_group": 2,
                                                          "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    "gpt_oss": ("gpt_oss", GptOssTopKRouter, {"num_local_experts": EXPERTS}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_router_picks_transformers_experts_and_weights(case):
    model_type, reference_class, fields = CASES[case]
    config = _config(model_type, **fields)
    reference = reference_class(config)
    gen = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        reference.weight.copy_(torch.randn(reference.weight.shape, generator=gen))
        bias = getattr(reference, "e_score_correction_bias", None)
        if bias is None:
            bias = getattr(reference, "bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    hidden = torch.randn(40, HIDDEN, generator=gen)
    _, expected_weights, expected_ids = reference(hidden)
    layout = decoder_layout(model_type, config, 8).experts
    logits = F.linear(hidden, reference.weight, reference.bias if model_type == "gpt_oss" else None)
    correction = getattr(reference, "e_score_correction_bias", None)
    weights, ids = route(logits, layout, correction)
    order, expected_order = ids.sort(dim=-1)[1], expected_ids.sort(dim=-1)[1]
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order).float())
    if layout.groups > 1:  # the groups kept some tokens from experts they would otherwise pick
        _, ungrouped = route(logits, dataclasses.replace(layout, groups=1), correction)
        assert not torch.equal(ungrouped.sort(dim=-1)[0], ids.sort(dim=-1)[0])
