"""Whisper's logits rules for one decoding window (protocol.WhisperDecoding), bit-for-bit as transformers'
Whisper generate applies its processors: SuppressTokensAtBegin, then SuppressTokens, then
WhisperTimeStamp; `only_tokens` (language detection) masks the rest last. Worker only (torch)."""

from __future__ import annotations

from typing import Sequence

import torch

from crane_mp.protocol import WhisperDecoding

_NEG_INF = -float("inf")


def apply_whisper_rules(logits: torch.Tensor, generated: Sequence[int], rules: WhisperDecoding) -> torch.Tensor:
    """Mask `logits` ([vocab] or [rows, vocab] float32, every row with the same history) in place and
    return them. `generated`: the window's tokens after its prompt, so far.

    Called by the worker for each step of a request that carries `SamplingParams.whisper`, before
    sampling; the masks depend on `generated` only, so a recomputed (preempted) request gets the same."""
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits  # [rows, vocab], a view: writes reach `logits`
    if rules.begin_suppress_tokens and not generated:
        rows[:, rules.begin_suppress_tokens] = _NEG_INF
    if rules.suppress_tokens:
        rows[:, rules.suppress_tokens] = _NEG_INF
    if rules.timestamps:
        _timestamp_rules(rows, generated, rules)
    if rules.only_tokens:
        keep = rows[:, rules.only_tokens].clone()
        rows.fill_(_NEG_INF)
        rows[:, rules.only_tokens] = keep
    return logits


def _timestamp_rules(rows: torch.Tensor, generated: Sequence[int], rules: WhisperDecoding) -> None:
    """WhisperTimeStampLogitsProcessor: timestamps come in pairs (one alone only before EOS), never go
    back, the first token is one (at most max_initial_timestamp_index), and a timestamp is forced when
    their summed probability beats every text token."""
    begin = rules.timestamp_begin
    rows[:, rules.no_timestamps_token_id] = _NEG_INF
    last_was_timestamp = len(generated) >= 1 and generated[-1] >= begin
    penultimate_was_timestamp = len(generated) < 2 or generated[-2] >= begin
    if last_was_timestamp:
        if penultimate_was_timestamp:  # a pair just closed: text (or EOS) next
            rows[:, begin:] = _NEG_INF
        else:  # a segment's end: its pair, or EOS; no text
            rows[:, : rules.eos_token_id] = _NEG_INF
    timestamps = [token for token in generated if token >= begin]
    if timestamps:
        # A pair may repeat its first timestamp; anything else must move forward.
        lowest = timestamps[-1] if last_was_timestamp and not penultimate_was_timestamp else timestamps[-1] + 1
        rows[:, begin:lowest] = _NEG_INF
    if not generated:
        rows[:, :begin] = _NEG_INF
        if rules.max_initial_timestamp_index is not None:
            rows[:, begin + rules.max_initial_timestamp_index + 1:] = _NEG_INF
    logprobs = torch.nn.functional.log_softmax(rows.float(), dim=-1)
    timestamp_logprob = logprobs[:, begin:].logsumexp(dim=-1)
    max_text_logprob = logprobs[:, :begin].max(dim=-1).values
    rows[:, :begin].masked_fill_((timestamp_logprob > max_text_logprob).unsqueeze(-1), _NEG_INF)
