"""apply_whisper_rules masks exactly as transformers' Whisper processors do, in their order: the same
tensor, bit for bit, for every kind of history (no tokens yet, text, a lone timestamp, a pair)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from crane_mp.protocol import WhisperDecoding
from crane_mp.worker.sampling.whisper_logits import apply_whisper_rules

# make_whisper's layout: text ids, <|endoftext|> 400, ... <|notimestamps|> 414, then 1501 timestamps.
VOCAB, EOS, NO_TIMESTAMPS = 1916, 400, 414
BEGIN = NO_TIMESTAMPS + 1
PROMPT = [401, 402, 410]
SUPPRESS = [1, 2, 7, 90, 255, 401, 409, 410, 411, 412, 413]
BEGIN_SUPPRESS = [220, EOS]


def _rules(timestamps: bool, max_initial: int | None = 50) -> WhisperDecoding:
    return WhisperDecoding(suppress_tokens=SUPPRESS, begin_suppress_tokens=BEGIN_SUPPRESS, timestamps=timestamps,
                           timestamp_begin=BEGIN, no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS,
                           max_initial_timestamp_index=max_initial)


def _transformers(timestamps: bool, max_initial: int | None = 50) -> LogitsProcessorList:
    """The list generate builds (_retrieve_logit_processors), begin index at the first generated token."""
    processors = [SuppressTokensAtBeginLogitsProcessor(BEGIN_SUPPRESS, begin_index=len(PROMPT)),
                  SuppressTokensLogitsProcessor(SUPPRESS)]
    if timestamps:
        config = GenerationConfig(eos_token_id=EOS, no_timestamps_token_id=NO_TIMESTAMPS,
                                  max_initial_timestamp_index=max_initial)
        processors.append(WhisperTimeStampLogitsProcessor(config, begin_index=len(PROMPT)))
    return LogitsProcessorList(processors)


def _history(rng: random.Random) -> list[int]:
    """Tokens as a Whisper window produces them: timestamps rising, in pairs, text between."""
    tokens, stamp = [], BEGIN + rng.randrange(0, 50)
    for _ in range(rng.randrange(0, 12)):
        roll = rng.random()
        if roll < 0.5:
            tokens.append(rng.randrange(0, EOS))
        elif roll < 0.8:
            tokens.append(stamp)
        else:
            tokens += [stamp, stamp + rng.randrange(0, 3)]
        stamp = min(stamp + rng.randrange(0, 80), VOCAB - 3)
    return tokens


def _logits(rng: random.Random, rows: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = 6.0 * torch.randn(rows, VOCAB, generator=generator)
    # Sometimes the timestamps' summed probability beats every text token, sometimes not.
    logits[:, BEGIN:] += rng.choice([-4.0, 0.0, 2.0, 4.0])
    return logits


@pytest.mark.parametrize("timestamps, max_initial", [(True, 50), (True, None), (False, 50)])
def test_same_logits_as_transformers(timestamps, max_initial):
    rng = random.Random(0)
    reference = _transformers(timestamps, max_initial)
    forced = 0
    for _ in range(300):
        generated = _history(rng)
        logits = _logits(rng)
        expected = reference(torch.tensor([PROMPT + generated]), logits.clone())
        ours = apply_whisper_rules(logits.clone(), generated, _rules(timestamps, max_initial))
        assert torch.equal(ours, expected), generated
        forced += bool(timestamps and torch.isinf(ours[0, :BEGIN]).all())
    if timestamps:
        assert 0 < forced < 300  # both branches of "sample a timestamp" ran


def test_rows_and_one_dimension_are_masked_in_place():
    rng = random.Random(1)
    generated = [BEGIN + 3, 17, 250]
    batch = _logits(rng, rows=3)
    expected = _transformers(True)(torch.tensor([PROMPT + generated] * 3), batch.clone())
    view = batch[1]  # a row of the worker's batch: the mask must land in the batch
    assert apply_whisper_rules(view, generated, _rules(True)) is view
    assert torch.equal(batch[1], expected[1])
    assert torch.equal(apply_whisper_rules(batch, generated, _rules(True)), expected)


def test_only_tokens_is_language_detection():
    """transformers' detect_language: -inf everywhere but the language tokens, then argmax."""
    languages = [402, 403, 404, 405, 406, 407, 408]
    logits = _logits(random.Random(2))
    expected = logits.clone()
    mask = torch.ones(VOCAB, dtype=torch.bool)
    mask[languages] = False
    expected[:, mask] = -float("inf")
    ours = apply_whisper_rules(logits, [], WhisperDecoding(only_tokens=languages))
    assert torch.equal(ours, expected)
    assert int(ours.argmax(-1)) in languages


def test_first_token_is_a_timestamp_within_the_initial_limit():
    logits = torch.zeros(VOCAB)
    apply_whisper_rules(logits, [], _rules(True, max_initial=50))
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed == list(range(BEGIN, BEGIN + 51))
