"""Batched sampling on the device, with per-request sampling state (seeded generators, penalty counts).

Order per row, as vLLM applies it: raw logprobs -> grammar mask (structured output) -> logit_bias and
min_tokens suppression -> repetition, frequency and presence penalties -> temperature -> min_p -> top_k
-> top_p -> draw. A seeded request
draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from crane_mp.protocol import SamplingParams, TokenLogprobs
from crane_mp.worker.grammar import GrammarEngine
from crane_mp.worker.kernels.cpu_isa import native_ops


@dataclass(slots=True)
class SamplingState:
    """Worker-side per-request state, created when the request is first seen."""

    params: SamplingParams
    generator: torch.Generator | None = None
    seen_mask: torch.Tensor | None = None  # [vocab] bool: prompt + output tokens (repetition penalty)
    output_counts: torch.Tensor | None = None  # [vocab] float: output token counts (presence/frequency)
    num_output_tokens: int = 0
    suppress_ids: list[int] = field(default_factory=list)  # stop ids masked until min_tokens
    matcher: object | None = None  # llguidance matcher of a constrained request (grammar.py)


def new_sampling_state(
    params: SamplingParams, prompt_ids: list[int], vocab_size: int, eos_ids: tuple[int, ...], device: torch.device,
    grammars: GrammarEngine | None = None,
) -> SamplingState:
    state = SamplingState(params)
    if params.grammar is not None:
        if grammars is None:
            raise ValueError("this engine was built without structured output")
        state.matcher = grammars.new_matcher(params.grammar)
    if params.seed is not None:
        state.generator = torch.Generator(device=device)
        state.generator.manual_seed(params.seed)
    if params.uses_penalties:
        state.seen_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        state.seen_mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        state.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if params.min_tokens > 0:
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        state.suppress_ids = [t for t in stop_ids if 0 <= t < vocab_size]
    return state


def record_token(state: SamplingState, token_id: int) -> None:
    """Account a token that became part of the request's output (sampled, or replayed on resume)."""
    state.num_output_tokens += 1
    if state.matcher is not None:
        # A token the mask allowed always fits; if not, the matcher only allows EOS from now on.
        state.matcher.consume_token(token_id)
    if state.output_counts is not None:
        state.output_counts[token_id] += 1
        state.seen_mask[token_id] = True


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, grammars: GrammarEngine | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.grammars = grammars
        self._shared_generator = torch.Generator(device=device)
        self._shared_generator.manual_seed(torch.initial_seed() % (2**63))

    def sample(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, vocab] (any float dtype); returns one token id per row and logprobs where asked."""
        logits = logits.float()
        params = [s.params for s in states]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        logits = self._apply_processors(logits, states)
        if all(p.greedy for p in params):
            tokens = argmax_rows(logits)
        else:
            tokens = self._draw(logits, states)
        token_list = tokens.tolist()
        logprobs = self._gather_logprobs(raw_logprobs, tokens, params) if want_logprobs else []
        return token_list, logprobs

    def _apply_processors(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        constrained = [row for row, state in enumerate(states) if state.matcher is not None]
        if constrained:
            self.grammars.mask(logits, constrained, [states[row].matcher for row in constrained])
        for row, state in enumerate(states):
            p = state.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < self.vocab_size], device=self.device)
                bias = torch.tensor([p.logit_bias[t] for t in ids.tolist()], device=self.device)
                logits[row].index_add_(0, ids, bias)
            # min_tokens yields to a grammar that is complete (only EOS left): else no token would remain.
            if (state.suppress_ids and state.num_output_tokens < p.min_tokens
                    and not (state.matcher is not None and state.matcher.is_stopped())):
                logits[row, state.suppress_ids] = float("-inf")
            if state.seen_mask is not None:
                row_logits = logits[row]
                if p.repetition_penalty != 1.0:
                    penalised = torch.where(
                        row_logits > 0, row_logits / p.repetition_penalty, row_logits * p.repetition_penalty
                    )
                    row_logits.copy_(torch.where(state.seen_mask, penalised, row_logits))
                row_logits -= p.frequency_penalty * state.output_counts
                row_logits -= p.presence_penalty * (state.output_counts > 0).float()
        return logits

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        params = [s.params for s in states]
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=self.device)
        greedy_tokens = argmax_rows(logits)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)

        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=self.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        if any(0 < p.top_k < self.vocab_size or p.top_p < 1.0 for p in params):
            probs = self._top_k_top_p(probs, params)

        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; noise per row from the row's generator.
        noise = torch.empty_like(probs).exponential_(generator=self._shared_generator)
        for row, state in enumerate(states):
            if state.generator is not None:
                noise[row].exponential_(generator=state.generator)
        sampled = argmax_rows(probs / noise)
        return torch.where(greedy, greedy_tokens, sampled)

    def _top_k_top_p(self, probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params], device=self.device
        )
        top_p = torch.tensor([p.top_p for p in params], device=self.device)
        ranks = torch.arange(self.vocab_size, device=self.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        # Renormalise after top-k, then keep the smallest prefix whose mass reaches top_p (at least one token).
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)

    def _gather_logprobs(
        self, raw_logprobs: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_top = max(p.logprobs or 0 for p in params)
        top_values, top_ids = (raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None))
        out: list[TokenLogprobs | None] = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            n = p.logprobs
            ids = top_ids[row, :n].tolist() if n else []
            values = top_values[row, :n].tolist() if n else []
            out.append(TokenLogprobs(chosen[row], ids, values))
        return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of a [N, V] float32 tensor; the native CPU kernel is ~15x faster than torch's."""
    if native_ops(x.device):
        return torch.ops.crane_mp.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)
