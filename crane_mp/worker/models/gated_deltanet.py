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

from dataclasses import dataclass
from itertools import accumulate
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
    """L tokens of sequences (any leading dims: heads, or sequences and heads): q, k [..., L, dk]
    (normalised, q scaled), v [..., L, dv], g and beta [..., L], state [..., dk, dv] -> (out [..., L, dv],
    the state after the last token). Padding (here to whole blocks, or a shorter sequence's past its end)
    writes nothing where beta is 0 and decays nothing where g is 0."""
    length = q.shape[-2]
    pad = -length % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    lead, blocks = q.shape[:-2], q.shape[-2] // CHUNK
    q, k, v = (x.reshape(*lead, blocks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(*lead, blocks, CHUNK), beta.reshape(*lead, blocks, CHUNK)
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
        fresh = values[..., block, :, :] - reads[..., block, :, :] @ state  # the writes S does not hold yet
        out[..., block, :, :] = q_decayed[..., block, :, :] @ state + within[..., block, :, :] @ fresh
        state = state * block_decay[..., block, :, :] + k_to_end[..., block, :, :].transpose(-1, -2) @ fresh
    return out.reshape(*lead, -1, out.shape[-1])[..., :length, :], state


@dataclass(slots=True)
class PrefillGroup:
    """Prompt sequences of a step computed together, each padded to the longest: `gather[p, t]` is the
    step row of sequence p's t-th token (the step's row count past its end: a zero row), `valid` the
    padded positions (flattened) that hold rows, `rows` those rows, `lengths` [P], `seqs` the
    sequences' indices in the step (ForwardContext.spans order)."""

    seqs: list[int]
    lengths: torch.Tensor
    gather: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor


def prefill_groups(lengths: list[int], first: int, device: torch.device) -> list[PrefillGroup]:
    """The step's sequences from `first` on (its prompts; `lengths` of every sequence in row order),
    grouped so that padding each group to its longest costs at most half again its blocks."""
    starts = [0, *accumulate(lengths)]
    blocks = {index: -(-lengths[index] // CHUNK) for index in range(first, len(lengths))}
    groups: list[list[int]] = []
    for index in sorted(blocks, key=blocks.get):
        group = groups[-1] if groups else None
        if group and blocks[index] * (len(group) + 1) * 2 <= 3 * (sum(blocks[i] for i in group) + blocks[index]):
            group.append(index)
        else:
            groups.append([index])
    out = []
    for group in groups:
        longest = max(lengths[i] for i in group)
        gather = torch.full((len(group), longest), starts[-1], dtype=torch.long)
        for p, index in enumerate(group):
            gather[p, : lengths[index]] = torch.arange(starts[index], starts[index] + lengths[index])
        valid = (gather < starts[-1]).flatten().nonzero().flatten()
        out.append(PrefillGroup(group, torch.tensor([lengths[i] for i in group], device=device), gather.to(device),
                                valid.to(device), gather.flatten()[valid].to(device)))
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (weight w, not 1 + w), times SiLU of the gate, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, wide = x.dtype, x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. Its input projections (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a) are one matrix; `conv_state` and `recurrent_state` are bound by the runner to the state
    pool's tensors of this layer, indexed by slot."""

    recurrent = True  # keeps per-sequence state, no KV cache (CausalLM.attention_layers leaves it out)

    def __init__(self, config: ModelConfig, ops: Any = None) -> None:
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
        self.pending: tuple | None = None  # a verifying step's decode rows, until commit

    def finalize_weights(self) -> None:
        """Nothing to prepare after loading (CausalLM.load_weights calls it on every layer's mixer)."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution state, recurrent state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.value_heads, self.key_dim, self.value_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        states, rows = ctx.states, x.shape[0]
        mixed, z, *gates = self.in_proj(x).split(self.fused_sizes["in_proj"], dim=-1)
        if self.grouped_ba:  # per key head: b of its value heads, then a
            pairs = gates[0].reshape(rows, self.key_heads, 2, -1)
            gates = [pairs[:, :, 0].reshape(rows, -1), pairs[:, :, 1].reshape(rows, -1)]
        b, a = gates
        out = torch.empty(rows, self.value_heads, self.value_dim, dtype=torch.float32, device=x.device)
        decodes = states.num_decodes if states is not None else 0
        if decodes and states.waves is not None:
            out[:decodes] = self._decode_waves(mixed[:decodes], b[:decodes], a[:decodes], states)
        elif decodes:
            out[:decodes] = self._decode(mixed[:decodes], b[:decodes], a[:decodes], states.decode_slots)
        if decodes < len(ctx.spans):
            if ctx.prefill_groups is None:  # the step's layout, the same for every linear layer
                ctx.prefill_groups = prefill_groups([span.q_len for span in ctx.spans], decodes, x.device)
            padded = [F.pad(t, (0, 0, 0, 1)) for t in (mixed, b, a)]  # a zero row past the last
            for group in ctx.prefill_groups:
                slots = (torch.tensor([states.slots[i] for i in group.seqs], device=x.device)
                         if states is not None else None)
                out[group.rows] = self._prefill(group, slots, *padded)
        gated = self.norm(out.to(x.dtype), z.reshape(rows, self.value_heads, self.value_dim))
        return self.out_proj(gated.reshape(rows, -1))

    def _heads(self, conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries and keys (normalised; one per value head), values, the decay's log g and beta, in
        float32, from the convolution's output [..., conv_dim] and the b and a projections [..., heads]."""
        q, k, v = conv.split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.key_heads, self.key_dim)).float()
        k = k.unflatten(-1, (self.key_heads, self.key_dim)).float()
        v = v.unflatten(-1, (self.value_heads, self.value_dim)).float()
        if self.value_heads != self.key_heads:  # each key head serves several value heads
            ratio = self.value_heads // self.key_heads
            q, k = ((t.repeat_interleave(ratio, dim=-2) if not self.tiled
                     else t.repeat(*[1] * (t.dim() - 2), ratio, 1)) for t in (q, k))
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return l2_normalize(q), l2_normalize(k), v, g, beta

    def _decode(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                states: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One token of each of the step's decoding sequences: [decodes, value heads, value dim].
        `states`: (convolution, recurrent) tensors that `slots` index instead of the pool's."""
        conv_state, recurrent_state = states or (self.conv_state, self.recurrent_state)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        window = torch.cat([conv_state.index_select(0, slots), mixed[:, :, None]], dim=-1)
        # One output per channel: a product and a sum (a depthwise Conv1d call costs ten times that here).
        conv = (window.to(weight.dtype) * weight).sum(dim=-1)
        conv_state.index_copy_(0, slots, window[..., 1:].to(conv_state.dtype))
        q, k, v, g, beta = self._heads(_ACTIVATIONS[self.activation](conv), b, a)
        q = q / self.key_dim**0.5
        if self.step_op is not None:
            return self.step_op(q, k, v, g, beta, recurrent_state, slots)
        out, after = recurrent_step(q, k, v, g, beta, recurrent_state.index_select(0, slots).float())
        recurrent_state.index_copy_(0, slots, after.to(recurrent_state.dtype))
        return out

    def _decode_waves(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, states) -> torch.Tensor:
        """Decode rows of which several are one sequence's (a decode row and the proposals after it):
        each wave of rows one decode step, as plain decoding takes each of them, on copies of the
        sequences' states. The pool's stay as they were until `commit` replays the rows kept."""
        slots = states.decode_slots
        owners = torch.unique(slots, return_inverse=True)[1]  # each row's sequence, as a row of the copies
        seq_slots = torch.zeros(int(owners.max()) + 1, dtype=slots.dtype, device=slots.device)
        seq_slots.index_copy_(0, owners, slots)
        copies = (self.conv_state.index_select(0, seq_slots), self.recurrent_state.index_select(0, seq_slots))
        out = mixed.new_empty(mixed.shape[0], self.value_heads, self.value_dim, dtype=torch.float32)
        for rows in states.waves:
            out[rows] = self._decode(mixed[rows], b[rows], a[rows], owners[rows], copies)
        self.pending = (mixed, b, a, slots, states.waves, owners, seq_slots, copies)
        return out

    def commit(self, kept: torch.Tensor) -> None:
        """After a verifying step: the pool's states advance by the decode rows kept ([decode rows] of
        bools; each sequence's first rows). A sequence that kept all its rows takes its copies' states;
        the others replay their rows kept, the same steps `_decode_waves` took on the copies."""
        mixed, b, a, slots, waves, owners, seq_slots, copies = self.pending
        self.pending = None
        whole = torch.bincount(owners[kept], minlength=seq_slots.numel()) == torch.bincount(owners)
        taken = whole.nonzero()[:, 0]
        if taken.numel():
            self.conv_state.index_copy_(0, seq_slots[taken], copies[0].index_select(0, taken))
            self.recurrent_state.index_copy_(0, seq_slots[taken], copies[1].index_select(0, taken))
        replayed = kept & ~whole[owners]
        for rows in waves:
            rows = rows[replayed[rows]]
            if rows.numel():
                self._decode(mixed[rows], b[rows], a[rows], slots[rows])

    def _prefill(self, group: PrefillGroup, slots: torch.Tensor | None, mixed: torch.Tensor, b: torch.Tensor,
                 a: torch.Tensor) -> torch.Tensor:
        """A group's prompt rows, each sequence from its saved state (`slots`; None: empty, kept
        nowhere): [rows of the group, value heads, value dim], in group.rows' order."""
        weight, history = self.conv1d.weight, self.kernel - 1
        inputs = mixed[group.gather].transpose(1, 2)  # [P, conv_dim, longest]
        before = (self.conv_state.index_select(0, slots).to(inputs.dtype) if slots is not None
                  else inputs.new_zeros(inputs.shape[0], self.conv_dim, history))
        window = torch.cat([before, inputs], dim=-1)
        conv = F.conv1d(window.to(weight.dtype), weight, groups=self.conv_dim).transpose(1, 2)  # [P, L, conv_dim]
        if slots is not None:  # each sequence's last inputs: window positions [length, length + history)
            last = (group.lengths[:, None] + torch.arange(history, device=window.device))[:, None, :]
            self.conv_state.index_copy_(0, slots, window.gather(2, last.expand(-1, self.conv_dim, -1))
                                        .to(self.conv_state.dtype))
        q, k, v, g, beta = self._heads(_ACTIVATIONS[self.activation](conv), b[group.gather], a[group.gather])
        real = (group.gather < mixed.shape[0] - 1).float()[..., None]  # padding writes and decays nothing
        g, beta = g * real, beta * real
        before = (self.recurrent_state.index_select(0, slots).float() if slots is not None
                  else q.new_zeros(q.shape[0], self.value_heads, self.key_dim, self.value_dim))
        out, after = chunked((q * self.key_dim**-0.5).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             g.transpose(1, 2), beta.transpose(1, 2), before)
        if slots is not None:
            self.recurrent_state.index_copy_(0, slots, after.to(self.recurrent_state.dtype))
        return out.transpose(1, 2).flatten(0, 1)[group.valid]


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}
