"""Llama 2/3 and Mistral: pre-norm decoder, GQA, rope (Llama-3 scaling via the config), SwiGLU MLP."""

from __future__ import annotations

from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention


class LlamaForCausalLM(CausalLM):
    attention_class = PagedSelfAttention
