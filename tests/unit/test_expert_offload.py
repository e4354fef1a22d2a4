"""Which layers of a GGUF mixture keep their experts in host memory beside a GPU (weights/offload.py):
as many first layers as the memory limit needs, or the first --cpu-moe-layers, and the start-up line."""

from __future__ import annotations

from collections import Counter

from crane_mp.models.gguf_file import GGUFContents, TensorInfo
from crane_mp.worker.weights.offload import describe, expert_bytes_by_layer, host_expert_layers

GIB = 2**30


def test_each_layers_expert_tensors_are_summed():
    names = {"blk.0.ffn_gate_exps.weight": 3, "blk.0.ffn_up_exps.weight": 3, "blk.0.ffn_down_exps.weight": 4,
             "blk.0.attn_q.weight": 100, "blk.2.ffn_gate_up_exps.weight": 6, "blk.2.ffn_down_exps.bias": 1,
             "blk.2.ffn_gate_inp.weight": 50, "blk.2.ffn_gate_shexp.weight": 70}
    contents = GGUFContents(None, {}, Counter(), {name: TensorInfo(name, 0, (n,), 0, n) for name, n in names.items()})
    assert expert_bytes_by_layer(contents) == {0: 10, 2: 7}


def test_as_few_first_layers_as_the_budget_needs():
    experts = {layer: 2 * GIB for layer in range(1, 6)}  # layer 0 dense
    total = 12 * GIB
    assert host_expert_layers(None, experts, total, 12 * GIB) == []
    assert host_expert_layers(None, experts, total, 11 * GIB) == [1]
    assert host_expert_layers(None, experts, total, 8 * GIB) == [1, 2]
    assert host_expert_layers(None, experts, total, 1 * GIB) == [1, 2, 3, 4, 5]  # still too big: the plan says so


def test_the_flag_takes_the_first_layers_with_experts_whatever_fits():
    experts = {layer: GIB for layer in (3, 1, 2)}
    assert host_expert_layers(2, experts, 3 * GIB, 100 * GIB) == [1, 2]
    assert host_expert_layers(0, experts, 3 * GIB, 0) == []
    assert host_expert_layers(9, experts, 3 * GIB, 0) == [1, 2, 3]


def test_the_start_up_line_names_the_layers_and_their_bytes():
    experts = {layer: GIB for layer in range(4)}
    assert describe([], experts) == "every layer's experts on the GPU"
    assert describe([0, 1], experts).startswith("experts of layers 0-1 (2 of 4) in host memory, 2.0 GiB")
    assert "[0, 2]" in describe([0, 2], experts)
