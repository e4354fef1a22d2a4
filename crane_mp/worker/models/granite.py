"""Granite 4 dense (granitemoehybrid checkpoints whose every layer is attention): Granite 3's layer
(multipliers in the DecoderLayout) with its MLP stored as one fused gate-up matrix under other names;
Granite MoE: the same layer with a mixture of experts (moe.py), its experts stored stacked."""

from __future__ import annotations

from crane_mp.worker.models.llama import LlamaForCausalLM


class Granite4ForCausalLM(LlamaForCausalLM):
    renamed_weights = {"shared_mlp.input_linear": "mlp.gate_up_proj", "shared_mlp.output_linear": "mlp.down_proj"}


class GraniteMoeForCausalLM(LlamaForCausalLM):
    # The released checkpoints' names, then transformers 5's in-memory ones (experts.*, router.weight).
    renamed_weights = {"block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
                       "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
                       "router.layer.": "router.", "block_sparse_moe.router.": "mlp.gate.", "block_sparse_moe.": "mlp."}
