"""DeepSeek-V2 and V3: multi-head latent attention over Llama's pre-norm layer, and mixtures of experts
with shared experts (moe.py; the routers are the layout's).

The KV cache keeps one row per token and layer: the normalised `kv_rank`-wide latent, then the
`rope_dim` key part that carries the position (576 values for V3's shapes, where full heads would be
128 x 2 x 192). Attention runs on the latent ("absorbed"): each head's query no-rope part is taken
through that head's key projection into the latent space, so a query row is [latent part, rope part]
against the cache rows as keys, with the rows' latent part as the values (one KV head, values within
the keys: the cache holds a single tensor); each head's latent output then goes through its value
projection. The scores and outputs are the full-head computation's, regrouped.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.cache.attention import paged_attention
from crane_mp.worker.models.checkpoint import fill
from crane_mp.worker.models.layers import CausalLM, RMSNorm
from crane_mp.worker.models.rope import apply_rope
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.forward_context import get_forward_context

_LATENT_EPS = 1e-6  # the latents' norms use DeepSeek's default epsilon, not the config's


class _Matrix(nn.Module):
    """A projection only ever read whole, as heads' matrices (kv_b_proj): no packed linear kernels."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns), requires_grad=False)


class LatentSelfAttention(nn.Module):
    latent_kv = True  # the runner keeps one cache tensor per layer: the values are in the key rows
    qk_norm_position = None  # its norms are the latents', not per-head query/key norms

    def __init__(self, config: ModelConfig, platform: Platform, layer: int = 0) -> None:
        super().__init__()
        latent = config.layout.latent
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.num_kv_heads = heads, 1
        self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim = latent.kv_rank, latent.nope_dim, latent.rope_dim, \
            latent.v_dim
        self.head_dim = latent.kv_rank + latent.rope_dim  # a cache row
        self.window = None
        self.scale = config.layout.attention_scale
        self.interleaved = config.layout.rope_interleaved
        query = heads * (latent.nope_dim + latent.rope_dim)
        if latent.q_rank:
            self.q_a_proj = nn.Linear(hidden, latent.q_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(latent.q_rank, _LATENT_EPS)
            self.q_b_proj = nn.Linear(latent.q_rank, query, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, query, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, latent.kv_rank + latent.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(latent.kv_rank, _LATENT_EPS)
        self.kv_b_proj = _Matrix(heads * (latent.nope_dim + latent.v_dim), latent.kv_rank)
        self.o_proj = nn.Linear(heads * latent.v_dim, hidden, bias=config.attention_bias)
        self.k_cache: torch.Tensor | None = None  # bound by the runner: [blocks, block_size, 1, head_dim]
        self.v_cache: torch.Tensor | None = None  # the same tensor
        self.kv_group = 0

    def finalize_weights(self) -> None:
        """Nothing to stack: kv_b_proj is read as each head's key and value matrices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        tokens = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope = apply_rope(q_rope.contiguous(), ctx.cos, ctx.sin, self.interleaved)
        k_rope = apply_rope(k_rope.reshape(tokens, 1, self.rope_dim), ctx.cos, ctx.sin, self.interleaved)
        meta = ctx.attn_of(self)
        rows = torch.cat([latent, k_rope.view(tokens, self.rope_dim)], dim=-1)
        self.k_cache.view(-1, self.head_dim).index_copy_(0, meta.slot_mapping, rows.to(self.k_cache.dtype))
        heads = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        key_up, value_up = heads[:, : self.nope_dim], heads[:, self.nope_dim :]  # [H, nope | v, kv_rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), key_up).transpose(0, 1)  # [T, H, kv_rank]
        query = torch.cat([q_latent, q_rope], dim=-1)
        out = paged_attention(query, None, None, self.k_cache, self.v_cache, meta, self.scale)
        out = out.view(tokens, self.num_heads, self.head_dim)[..., : self.kv_rank]
        values = torch.bmm(out.transpose(0, 1), value_up.transpose(1, 2))  # [H, T, v]
        return self.o_proj(values.transpose(0, 1).reshape(tokens, self.num_heads * self.v_dim))


# Checkpoint names of the shared experts and the sigmoid router's correction (DeepSeek, GLM-4.5) as ours.
SHARED_EXPERT_NAMES = {"mlp.shared_experts.": "mlp.shared_expert.",
                       "mlp.gate.e_score_correction_bias": "mlp.correction_bias"}


class DeepseekForCausalLM(CausalLM):
    attention_class = LatentSelfAttention
    renamed_weights = SHARED_EXPERT_NAMES
    skips_extra_layers = True  # V3's multi-token-prediction layer (num_nextn_predict_layers): its own model
    prediction_layer = "nextn"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        joined: set[str] = set()
        return super().load_weights(self._joined_kv_b(weights, joined)) | joined

    def _joined_kv_b(self, weights: Iterable[tuple[str, torch.Tensor]],
                     joined: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, a GGUF file's kv_b_proj halves (llama.cpp's converter splits it into
        each head's key part, transposed, and value part) put back into kv_b_proj (names into `joined`)."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            stem, _, leaf = name.rpartition(".")
            if not stem.endswith(("self_attn.k_b_proj", "self_attn.v_b_proj")):
                yield name, tensor
                continue
            module = stem.rpartition(".")[0]
            parts = halves.setdefault(module, {})
            parts[stem.rpartition(".")[2]] = tensor
            if len(parts) == 2:
                attention = self.get_submodule(self.parameter_name(module))
                heads = attention.kv_b_proj.weight.data.view(attention.num_heads, -1, attention.kv_rank)
                fill(heads[:, : attention.nope_dim], parts["k_b_proj"].transpose(1, 2), f"{module}.k_b_proj")
                fill(heads[:, attention.nope_dim :], parts["v_b_proj"], f"{module}.v_b_proj")
                joined.add(f"{self.parameter_name(module)}.kv_b_proj.weight")
                del halves[module]
        if halves:
            raise KeyError(f"kv_b_proj halves without their other half: {sorted(halves)}")
