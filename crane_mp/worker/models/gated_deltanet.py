"""Gated DeltaNet: the linear-attention layers of Qwen3.5 and Qwen3-Next.

Each sequence carries, per layer, the last conv_kernel - 1 inputs of a causal depthwise convolution
and a recurrent state S [value heads, key dim, value dim] (worker/cache/state_pool.py holds them, one
slot per running sequence). A token's keys write into S by the delta rule, gated by a per-head decay:

    S <- S * exp(g);  S <- S + k (beta * (v - S^T k))^T;  out = S^T q

A decode token takes that step directly; a prompt (or a chunk of one) runs in blocks of CHUNK tokens,
where the writes inside a block are solved at once (a unit lower-triangular system, the "UT transform")
and the block reads S once: a loop over blocks, never over tokens. Queries and keys are L2-normalised,
queries scaled by 1/sqrt(key dim), all of it in float32 whatever the model's dtype; the output goes
through an RMSNorm gated by SiLU of a projection of the input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.config import ModelConfig
from crane_mp.worker.step.forward_context import get_forward_context

CHUNK = 64  # tokens whose state writes one block solves at once
_L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, dk] (normalised, q scaled), v [B, H, dv], g and beta [B, H],
    state [B, H, dk, dv] -> (out [B, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what S already returns for k: [B, H, dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one sequence: q, k [H, L, dk] (normalised, q scaled), v [H, L, dv], g and beta [H, L],
    state [H, dk, dv] -> (out [H, L, dv], the state after the last token). Padding to whole blocks
    writes nothing (beta 0) and decays nothing (g 0)."""
    length = q.shape[1]
    pad = -length % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, blocks = q.shape[0], q.shape[1] // CHUNK
    q, k, v = (x.reshape(heads, blocks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, blocks, CHUNK), beta.reshape(heads, blocks, CHUNK)
    decay = g.cumsum(dim=-1)  # log of the decay from the block's start through each token
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    # Decay between token j and a later token i of a block: exp(decay_i - decay_j), zero above the diagonal.
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * between  # its strictly lower part: earlier writes seen by later keys
    within = (q @ k.transpose(-1, -2)) * between
    # The block's writes once each sees the earlier ones (the diagonal taken as 1).
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    block_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for block in range(blocks):
        fresh = values[:, block] - reads[:, block] @ state  # the part of the writes S does not hold yet
        out[:, block] = q_decayed[:, block] @ state + within[:, block] @ fresh
        state = state * block_decay[:, block] + k_to_end[:, block].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (weight w, not 1 + w), times SiLU of the gate, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. Its input projections (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a) are one matrix; `conv_state` and `recurrent_state` are bound by the runner to the state
    pool's tensors of this layer, indexed by slot."""

    recurrent = True  # keeps per-sequence state, no KV cache (CausalLM.attention_layers leaves it out)

    def __init__(self, config: ModelConfig, layer: int = 0, ops: Any = None) -> None:
        """`ops`: the platform's fused kernels (Platform.elementwise): the decode step runs as one where
        they have it (the native CPU op)."""
        super().__init__()
        self.step_op = getattr(ops, "gated_delta_step_", None) if ops is not None else None
        shape = config.layout.linear
        self.key_heads, self.value_heads = shape.key_heads, shape.value_heads
        self.key_dim, self.value_dim = shape.key_dim, shape.value_dim
        self.conv_dim, self.kernel = shape.conv_dim, shape.conv_kernel
        values = self.value_heads * self.value_dim
        self.grouped_ba, self.tiled = shape.grouped_ba, shape.tiled_value_heads
        gates = [2 * self.value_heads] if self.grouped_ba else [self.value_heads, self.value_heads]
        self.fused_sizes = {"in_proj": [self.conv_dim, values, *gates]}
        self.in_proj = nn.Linear(config.hidden_size, sum(self.fused_sizes["in_proj"]), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, config.hidden_size, bias=False)
        self.activation = config.hidden_act
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1], the compute dtype
        self.recurrent_state: torch.Tensor | None = None  # [slots, value heads, key dim, value dim]

    def finalize_weights(self) -> None:
        """Nothing to prepare after loading (CausalLM.load_weights calls it on every layer's mixer)."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution state, recurrent state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.value_heads, self.key_dim, self.value_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        states = ctx.states
        lengths = [span.q_len for span in ctx.spans]
        mixed, z, *gates = self.in_proj(x).split(self.fused_sizes["in_proj"], dim=-1)
        if self.grouped_ba:  # per key head: b of its value heads, then a
            pairs = gates[0].reshape(x.shape[0], self.key_heads, 2, -1)
            gates = [pairs[:, :, 0].reshape(x.shape[0], -1), pairs[:, :, 1].reshape(x.shape[0], -1)]
        b, a = gates
        conv = self._convolve(mixed, lengths, states)
        q, k, v = conv.split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim], dim=-1)
        rows = x.shape[0]
        q = q.reshape(rows, self.key_heads, self.key_dim).float()
        k = k.reshape(rows, self.key_heads, self.key_dim).float()
        v = v.reshape(rows, self.value_heads, self.value_dim).float()
        if self.value_heads != self.key_heads:  # each key head serves several value heads
            ratio = self.value_heads // self.key_heads
            q, k = ((t.repeat(1, ratio, 1) if self.tiled else t.repeat_interleave(ratio, dim=1)) for t in (q, k))
        q, k = l2_normalize(q), l2_normalize(k)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self._attend(q, k, v, g, beta, lengths, states)  # [rows, value heads, value dim]
        gated = self.norm(out.to(x.dtype), z.reshape(rows, self.value_heads, self.value_dim))
        return self.out_proj(gated.reshape(rows, -1))

    def _weight(self) -> torch.Tensor:
        return self.conv1d.weight  # [conv_dim, 1, kernel]

    def _convolve(self, mixed: torch.Tensor, lengths: list[int], states) -> torch.Tensor:
        """The causal convolution of each sequence's rows after its saved inputs, then the activation;
        the sequences' last kernel - 1 inputs are saved back."""
        history = self.kernel - 1
        out = torch.empty_like(mixed)
        decodes = states.num_decodes if states is not None else 0
        if decodes:
            slots = states.decode_slots
            window = torch.cat([self.conv_state.index_select(0, slots), mixed[:decodes, :, None]], dim=-1)
            out[:decodes] = F.conv1d(window.to(self._weight().dtype), self._weight(), groups=self.conv_dim)[..., -1]
            self.conv_state.index_copy_(0, slots, window[..., 1:].to(self.conv_state.dtype))
        row = decodes
        for index in range(decodes, len(lengths)):
            length = lengths[index]
            seq = mixed[row : row + length].t()
            slot = states.slots[index] if states is not None else None
            before = self.conv_state[slot] if slot is not None else seq.new_zeros(self.conv_dim, history)
            window = torch.cat([before.to(seq.dtype), seq], dim=-1)
            out[row : row + length] = F.conv1d(window[None].to(self._weight().dtype), self._weight(),
                                               groups=self.conv_dim)[0].t()
            if slot is not None:
                self.conv_state[slot] = window[:, -history:]
            row += length
        return _ACTIVATIONS[self.activation](out)

    def _attend(self, q, k, v, g, beta, lengths: list[int], states) -> torch.Tensor:
        out = torch.empty_like(v)
        decodes = states.num_decodes if states is not None else 0
        if decodes:
            slots, q_scaled = states.decode_slots, q[:decodes] / self.key_dim**0.5
            if self.step_op is not None:
                out[:decodes] = self.step_op(q_scaled, k[:decodes], v[:decodes], g[:decodes], beta[:decodes],
                                             self.recurrent_state, slots)
            else:
                before = self.recurrent_state.index_select(0, slots).float()
                out[:decodes], after = recurrent_step(q_scaled, k[:decodes], v[:decodes], g[:decodes],
                                                      beta[:decodes], before)
                self.recurrent_state.index_copy_(0, slots, after.to(self.recurrent_state.dtype))
        row = decodes
        scale = self.key_dim**-0.5
        for index in range(decodes, len(lengths)):
            rows = slice(row, row + lengths[index])
            slot = states.slots[index] if states is not None else None
            before = (self.recurrent_state[slot].float() if slot is not None
                      else q.new_zeros(self.value_heads, self.key_dim, self.value_dim))
            seq_out, after = chunked((q[rows] * scale).transpose(0, 1), k[rows].transpose(0, 1),
                                     v[rows].transpose(0, 1), g[rows].t(), beta[rows].t(), before)
            out[rows] = seq_out.transpose(0, 1)
            if slot is not None:
                self.recurrent_state[slot] = after.to(self.recurrent_state.dtype)
            row += lengths[index]
        return out


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}
