"""The CUDA path's grouped expert matmuls (crane_mp/worker/kernels/triton_moe.py), run on CPU through
Triton's interpreter: the pairs sorted into blocks on the device, and a mixture's experts through them
equal to one matmul an expert, with unused experts, one token, tokens choosing alike, and biases; the
tokens routed to each expert counted on the device.
Skipped without Triton."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHECK = """
import torch
import torch.nn.functional as F
from crane_mp.models.layouts import ExpertLayout
from crane_mp.worker.kernels import triton_moe
from crane_mp.worker.models.moe import Experts, RoutingTable

cases = 0
for dtype, experts, top_k, tokens, bias in [
    (torch.float32, 8, 2, 37, False), (torch.bfloat16, 16, 4, 1, False), (torch.float32, 8, 8, 5, True),
    (torch.bfloat16, 4, 2, 40, True),
]:
    gen = torch.Generator().manual_seed(experts * tokens)
    hidden, inter = 48, 40  # neither a multiple of the tiles
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    pool = experts - 1 if top_k < experts else experts  # the last expert gets no pair where it can
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2] = torch.arange(top_k)  # half the tokens alike: an expert with more than a block of pairs
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)

    blocks = triton_moe.PairBlocks(ids, experts, triton_moe.block_rows(dtype))
    assert blocks.counts.tolist() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    used = blocks.pairs[blocks.pairs < ids.numel()]
    assert sorted(used.tolist()) == list(range(ids.numel()))  # every pair once
    w = torch.randn(experts, 2 * inter, hidden, generator=gen).to(dtype)
    out = triton_moe.grouped_matmul(x, w, blocks, top_k)
    want = torch.stack([x[p // top_k].float() @ w[ids.reshape(-1)[p]].float().T for p in range(ids.numel())])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol * 10, rtol=tol)

    layout = ExpertLayout(num_experts=experts, top_k=top_k, intermediate_size=inter, bias=bias)
    moe = Experts(experts, hidden, inter, F.silu, None, layout).to(dtype)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    plain = moe(x, ids, weights).float()
    moe.grouped = triton_moe
    table = RoutingTable([moe], x.device)  # the grouped path counts its pairs on the device
    grouped = moe._grouped_forward(x, ids, weights).float()
    assert table.totals() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    # Each path rounds its bf16 intermediates once, in its own order: compared at the outputs' scale.
    torch.testing.assert_close(grouped, plain, atol=tol * plain.abs().max().item(), rtol=tol)
    cases += 1
assert triton_moe.verified(torch.device("cpu"), torch.float32)  # the start-up check passes where the kernel is right
print("checked", cases)
"""


@pytest.mark.slow  # the Triton kernel interpreted with numpy
def test_grouped_expert_matmuls_equal_one_matmul_an_expert_in_the_interpreter():
    assert "checked 4" in run_interpreted(_CHECK)
