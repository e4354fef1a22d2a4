"""Granite 4 dense (granitemoehybrid checkpoints whose every layer is attention): Granite 3's layer
(multipliers in the DecoderLayout) with its MLP stored as one fused gate-up matrix under other names."""

from __future__ import annotations

from crane_mp.worker.models.llama import LlamaForCausalLM


class Granite4ForCausalLM(LlamaForCausalLM):
    renamed_weights = {"shared_mlp.input_linear": "mlp.gate_up_proj", "shared_mlp.output_linear": "mlp.down_proj"}
