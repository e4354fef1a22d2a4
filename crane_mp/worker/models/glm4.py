"""GLM-4 (0414): Llama's attention with q/k/v biases and rope on the first half of each head in
interleaved pairs, four norms per layer under its own names, and a checkpoint that fuses gate and up.
GLM-4.5 (glm4_moe): Llama's layer with q/k/v biases and rope on the first half of each head (halves, not
pairs), and DeepSeek-V3's mixture of experts (sigmoid router, shared experts, dense first layers)."""

from __future__ import annotations

from crane_mp.worker.models.deepseek import SHARED_EXPERT_NAMES
from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention
from crane_mp.worker.models.llama import LlamaForCausalLM


class Glm4ForCausalLM(CausalLM):
    attention_class = PagedSelfAttention
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4MoeForCausalLM(LlamaForCausalLM):
    renamed_weights = SHARED_EXPERT_NAMES
    skips_extra_layers = True  # the released checkpoints' next-token-prediction layer (num_nextn_predict_layers)
