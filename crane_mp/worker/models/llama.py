"""Llama 2/3 and Mistral: pre-norm decoder, GQA, rope (Llama-3 scaling via the config), SwiGLU MLP.

The same layers serve the families whose differences the DecoderLayout carries: Phi-3 (partial rotary,
fused qkv and gate-up checkpoints), SmolLM3 (no-rope layers), Granite (multipliers), Seed-OSS (biases),
EXAONE 4 (with Qwen3's q/k norms) and Cohere2 (parallel blocks, LayerNorm, interleaved rope).
"""

from __future__ import annotations

from crane_mp.worker.models.layers import CausalLM, PagedSelfAttention


class LlamaForCausalLM(CausalLM):
    attention_class = PagedSelfAttention
