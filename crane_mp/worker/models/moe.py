"""Mixture-of-experts MLPs: a router picks each token's top k experts and weighs their outputs
(ExpertLayout says how: softmax then top k, renormalised or not, the top k logits then a softmax, or
sigmoid scores chosen with a correction bias; limited to the best groups of experts, scaled), and the
experts run once each over the rows routed to them.

The step's (token, expert) pairs are sorted by expert, so each expert's matrices are read once for
all of its rows, in one matmul; a token's outputs are summed in expert order, as transformers sums
them. An expert's gate and up projections are stored stacked ([experts, 2 x intermediate, hidden]),
its down projection beside them ([experts, hidden, intermediate]), filled from per-expert checkpoint
tensors or from checkpoints that stack them already (Granite MoE). On CUDA, float experts of a decode
step run as two grouped matmuls over the pairs sorted on the device (kernels/triton_moe.py), with no
host synchronisation.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from crane_mp.models.layouts import ExpertLayout
from crane_mp.worker.models.checkpoint import fill

# A per-expert checkpoint tensor's projection -> (our stacked parameter, which of its row halves).
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", None)}
_BIASES = {"gate_up_proj": "gate_up_bias", "down_proj": "down_bias"}  # a stacked parameter's biases


class RoutedExperts(nn.Module):
    """A layer's experts, each run once over the rows routed to it; subclasses hold the weights and
    `run` the experts over their rows."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Callable[[torch.Tensor], torch.Tensor], ops: Any = None, layout: ExpertLayout | None = None,
                 ) -> None:
        """`layout`: where the experts add biases or clamp their SwiGLU (gpt-oss); None: neither."""
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.act = act
        self.swiglu = None if layout is None or layout.swiglu_limit is None else (layout.swiglu_limit,
                                                                                  layout.swiglu_alpha)
        self.ops = ops if act is F.silu and self.swiglu is None else None  # the fused SiLU*mul
        bias = layout is not None and layout.bias
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size), requires_grad=False) \
            if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None
        # Tokens routed to each expert since the runner last read them (its routing table's row), or None.
        self.routed: np.ndarray | None = None
        # The CUDA platform's grouped matmuls over pairs sorted on the device (triton_moe), where the
        # experts' weights are float matrices it can read, and the routing table's device row they count
        # into; None: one matmul an expert.
        self.grouped = None
        self.routed_on_device: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; ids, weights [T, k]: each token's experts and their weights -> [T, hidden]."""
        # Grouped on CUDA while an expert averages at most a block of pairs (decode batches); longer runs
        # (prompts) keep one cuBLAS matmul an expert.
        grouped = self.grouped
        if (grouped is not None and x.is_cuda and ids.numel() <= self.num_experts * grouped.block_rows(x.dtype)
                and grouped.verified(x.device, x.dtype)):
            return self._grouped_forward(x, ids, weights)
        k = ids.shape[1]
        if ids.shape[0] == 1:  # one token (a lone decode): its experts in order, its row once each
            experts, order = ids[0].sort()
            chosen = experts.tolist()
            if self.routed is not None:
                self.routed[chosen] += 1
            out = self.run(x.expand(k, -1).contiguous(), chosen, [1] * k)
            return (out * weights[0].index_select(0, order).to(out.dtype)[:, None]).sum(0, keepdim=True)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # pairs by expert, each expert's in token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        active = [expert for expert, count in enumerate(counts) if count]
        if self.routed is not None:
            self.routed += counts
        out = self.run(x.index_select(0, tokens), active, [counts[expert] for expert in active])
        out.mul_(weights.reshape(-1).index_select(0, order).to(out.dtype)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _grouped_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward on the device alone: a token's pairs in expert order (its outputs summed in that order),
        both projections as grouped matmuls over them."""
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order)
        blocks = self.grouped.PairBlocks(ids, self.num_experts, self.grouped.block_rows(x.dtype))
        if self.routed_on_device is not None:
            self.routed_on_device += blocks.counts
        chosen = ids.reshape(-1)
        gate_up = self.grouped.grouped_matmul(x.contiguous(), self.gate_up_proj, blocks, ids.shape[1])
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias[chosen].to(gate_up.dtype)
        out = self.grouped.grouped_matmul(self._activate(gate_up).contiguous(), self.down_proj, blocks, 1)
        if self.down_bias is not None:
            out += self.down_bias[chosen].to(out.dtype)
        return (out.view(*ids.shape, -1) * weights[..., None].to(out.dtype)).sum(1)

    def load_bias(self, projection: str, tensor: torch.Tensor, name: str) -> list[str]:
        """Fill every expert's `projection` bias from one stacked tensor [experts, rows] (a GGUF file's);
        returns the part's key, as `expected_parts` names it."""
        param, half = EXPERT_PROJECTIONS[projection]
        bias = self.gate_up_bias if param == "gate_up_proj" else self.down_bias
        if bias is None:
            raise KeyError(f"checkpoint tensor {name!r}: these experts have no biases")
        target = bias.data if half is None else bias.data[:, half * self.intermediate_size :
                                                             (half + 1) * self.intermediate_size]
        fill(target, tensor, name)
        return [f"{_BIASES[param]}#{projection}"]

    def expected_parts(self, param: str) -> set[str]:
        """The keys the load methods return for every part of stacked parameter `param`."""
        return {f"{param}#{projection}" for projection, (target, _) in EXPERT_PROJECTIONS.items()
                if _BIASES[target] == param}

    def run(self, rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Each expert of `experts` over its run of `rows` (counts[i] rows each, in order)."""
        gate_up = self.project_gate_up(rows, experts, counts)
        if self.gate_up_bias is not None:
            gate_up += _bias_rows(self.gate_up_bias, experts, counts)
        out = self.project_down(self._activate(gate_up), experts, counts)
        if self.down_bias is not None:
            out += _bias_rows(self.down_bias, experts, counts)
        return out

    def project_gate_up(self, rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Each expert's gate and up projections of its rows: [rows, 2 x intermediate], gates first."""
        raise NotImplementedError

    def project_down(self, hidden: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.swiglu is None:
            return self.act(gate) * up
        limit, alpha = self.swiglu  # transformers' order of operations, for its float32 tokens
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _bias_rows(bias: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
    """Each row's expert's bias, for rows grouped by expert (counts[i] of experts[i] each)."""
    chosen = bias[experts]
    if len(counts) == sum(counts):
        return chosen
    return chosen.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0)


class Experts(RoutedExperts):
    """Experts of float weights, stacked: gate and up [experts, 2 x intermediate, hidden], down
    [experts, hidden, intermediate]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Callable[[torch.Tensor], torch.Tensor], ops: Any = None, layout: ExpertLayout | None = None,
                 ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, act, ops, layout)
        self.grouped = getattr(ops, "grouped_experts", None)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, name: str) -> str:
        """Fill one expert's projection from checkpoint tensor `name`; returns the part's key, as
        `expected_parts` names it."""
        param, half = EXPERT_PROJECTIONS[projection]
        target = getattr(self, param).data[expert]
        if half is not None:
            target = target[half * self.intermediate_size : (half + 1) * self.intermediate_size]
        fill(target, tensor, name)
        return f"{param}#{expert}.{projection}"

    def load_stacked(self, projection: str, tensor: torch.Tensor, name: str) -> list[str]:
        """Fill every expert's `projection` from one stacked tensor [experts, rows, columns] (a GGUF
        file's); returns the parts' keys."""
        if tensor.dim() != 3 or tensor.shape[0] != self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, not one matrix for each "
                             f"of {self.num_experts} experts")
        return [self.load_expert(expert, projection, tensor[expert], name) for expert in range(self.num_experts)]

    def expected_parts(self, param: str) -> set[str]:
        if param in _BIASES.values():
            return super().expected_parts(param)
        return {f"{param}#{expert}.{projection}" for expert in range(self.num_experts)
                for projection, (target, _) in EXPERT_PROJECTIONS.items() if target == param}

    def project_gate_up(self, rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        return _per_expert(self.gate_up_proj, rows, experts, counts)

    def project_down(self, hidden: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        return _per_expert(self.down_proj, hidden, experts, counts)


def _per_expert(weights: torch.Tensor, rows: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
    """rows @ weights[expert].T, each expert over its run of rows."""
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, count in zip(experts, counts):
        out[start : start + count] = F.linear(rows[start : start + count], weights[expert])
        start += count
    return out


class RoutingTable:
    """Per mixture-of-experts layer, the tokens routed to each of its experts since the runner last read
    them: rows the layers count into, on the host where they group their rows there, on the device where
    they run grouped matmuls (read once a step, not synchronised once a layer)."""

    def __init__(self, layers: list[RoutedExperts], device: torch.device) -> None:
        width = max(layer.num_experts for layer in layers)
        self.host = np.zeros((len(layers), width), dtype=np.int64)
        self.device = torch.zeros(len(layers), width, dtype=torch.int64, device=device) \
            if any(layer.grouped is not None for layer in layers) else None
        for index, layer in enumerate(layers):
            layer.routed = self.host[index, : layer.num_experts]
            if self.device is not None:
                layer.routed_on_device = self.device[index, : layer.num_experts]

    def clear(self) -> None:
        self.host.fill(0)
        if self.device is not None:
            self.device.zero_()

    def totals(self) -> list[int]:
        """Each expert's tokens summed over the layers; [] when none were routed."""
        totals = self.host.sum(axis=0)
        if self.device is not None:
            totals = totals + self.device.sum(dim=0).cpu().numpy()
        return totals.tolist() if totals.any() else []


def routing_table(model: nn.Module) -> RoutingTable | None:
    """The routing table of `model`'s mixture-of-experts layers (None for a model without experts)."""
    layers = [module for module in model.modules() if isinstance(module, RoutedExperts)]
    if not layers:
        return None
    return RoutingTable(layers, next(model.parameters()).device)


def route(logits: torch.Tensor, layout: ExpertLayout,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, experts] -> each token's top_k (weights in float32, expert ids), as the family
    computes them; `correction`: the sigmoid router's bias, added to the scores for choosing only."""
    if layout.router == "topk_softmax":
        top, ids = logits.float().topk(layout.top_k, dim=-1)
        return top.softmax(dim=-1), ids
    sigmoid = layout.router == "sigmoid"
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(dim=-1)
    choice = scores if correction is None else scores + correction.float()
    if layout.groups > 1:
        choice = _best_groups(choice, layout, float("-inf") if sigmoid else 0.0)
    if sigmoid:
        ids = choice.topk(layout.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = choice.topk(layout.top_k, dim=-1)
    if layout.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * layout.scale if layout.scale != 1.0 else weights), ids


def _best_groups(choice: torch.Tensor, layout: ExpertLayout, fill: float) -> torch.Tensor:
    """`choice` with the experts outside each token's topk_groups best groups set to `fill`."""
    grouped = choice.view(choice.shape[0], layout.groups, -1)
    score = grouped.max(dim=-1).values if layout.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = score.topk(layout.topk_groups, dim=-1)[1]
    kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
    return choice.masked_fill(~kept[:, :, None].expand_as(grouped).reshape(choice.shape), fill)


class SparseMoE(nn.Module):
    """A layer's mixture-of-experts MLP: `gate` (the router), `experts`, and where the family has one a
    `shared_expert` every token goes through, scaled per token by sigmoid(`shared_expert_gate`)."""

    def __init__(self, hidden_size: int, layout: ExpertLayout, act: Callable[[torch.Tensor], torch.Tensor],
                 ops: Any = None, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.gate = nn.Linear(hidden_size, layout.num_experts, bias=layout.bias)
        self.experts: RoutedExperts = Experts(layout.num_experts, hidden_size, layout.intermediate_size, act, ops,
                                              layout)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if layout.shared_gate else None
        # The sigmoid router's score correction (DeepSeek-V3's e_score_correction_bias).
        self.correction_bias = nn.Parameter(torch.zeros(layout.num_experts), requires_grad=False) \
            if layout.router == "sigmoid" else None
        # The experts live in host memory beside a GPU (weights/offload.py): their rows go there and back.
        self.host_experts = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.layout, self.correction_bias)
        if self.host_experts:
            out = self.experts(x.to("cpu"), ids.to("cpu"), weights.to(x.dtype).to("cpu")).to(x.device)
        else:
            out = self.experts(x, ids, weights.to(x.dtype))
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared
