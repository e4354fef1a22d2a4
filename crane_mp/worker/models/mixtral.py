"""Mixtral: Llama's layer with a mixture of experts for its MLP (moe.py), checkpoint names of its own."""

from __future__ import annotations

from crane_mp.worker.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_weights = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}
