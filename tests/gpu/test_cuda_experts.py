"""A mixture's experts on CUDA at a 30B-A3B layer's shape (128 experts, top 8, hidden 2048, 768 wide):
the grouped matmuls over pairs sorted on the device equal one cuBLAS matmul an expert, for one token and
for decode batches, and count the tokens each expert took on the device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crane_mp.models.layouts import ExpertLayout
from crane_mp.worker.kernels import triton_elementwise, triton_moe
from crane_mp.worker.models.moe import Experts, RoutingTable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=WIDTH)
    module = Experts(EXPERTS, HIDDEN, WIDTH, F.silu, triton_elementwise, layout)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return module.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_grouped_experts_equal_one_matmul_an_expert(experts, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda().to(torch.bfloat16)
    assert experts.grouped is triton_moe and triton_moe.verified(x.device, x.dtype)
    table = RoutingTable([experts], x.device)
    grouped = experts._grouped_forward(x, ids, weights).float()
    assert table.totals() == torch.bincount(ids.reshape(-1).cpu(), minlength=EXPERTS).tolist()
    experts.grouped = None
    try:
        plain = experts(x, ids, weights).float()
    finally:
        experts.grouped = triton_moe
    torch.testing.assert_close(grouped, plain, atol=2e-2 * plain.abs().max().item(), rtol=2e-2)
