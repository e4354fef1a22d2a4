"""GLM-4 (0414): Llama's attention with q/k/v biases and rope on the first half of each head in
interleaved pairs, four norms per layer under its own names, and a checkpoint that fuses gate and up."""

from __future__ import annotations

from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention


class Glm4ForCausalLM(CausalLM):
    attention_class = PagedSelfAttention
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
