"""split_window cuts a window into the same segments, with the same float seconds and the same next seek,
as transformers' `_retrieve_segment`, for every way a window can end."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from crane_mp.frontend.audio.whisper_segments import split_window

BEGIN = 415  # <|0.00|> of make_whisper's vocabulary


def _reference(tokens: list[int], seek: int, num_frames: int):
    seek_tensor = torch.tensor([seek])
    time_offset = seek_tensor.to(torch.float64) * 0.02 / 2
    segments, offset = WhisperGenerationMixin._retrieve_segment(
        seek_sequence=torch.tensor(tokens, dtype=torch.long), seek_outputs=[None], time_offset=time_offset,
        timestamp_begin=BEGIN, seek_num_frames=torch.tensor([num_frames]), time_precision=0.02,
        time_precision_features=0.01, input_stride=2, prev_idx=0, idx=0, return_token_timestamps=False,
        decoder_input_ids=torch.tensor([[1, 2, 3]]))
    return [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in segments], int(offset)


def _window(rng: random.Random) -> list[int]:
    tokens, stamp = [], BEGIN + rng.randrange(0, 51)
    if rng.random() < 0.8:
        tokens.append(stamp)
    for _ in range(rng.randrange(0, 10)):
        tokens += [rng.randrange(0, 400) for _ in range(rng.randrange(1, 4))]
        stamp += rng.randrange(1, 150)
        ending = rng.random()
        if ending < 0.5:
            tokens += [stamp, stamp + rng.randrange(0, 2)]  # a closing pair
        elif ending < 0.7:
            tokens.append(stamp)
    return tokens


@pytest.mark.parametrize("seed", range(4))
def test_same_segments_as_transformers(seed):
    rng = random.Random(seed)
    kinds = set()
    for _ in range(250):
        tokens = _window(rng)
        seek, num_frames = rng.randrange(0, 9000), rng.choice([3000, rng.randrange(1, 3001)])
        expected_segments, expected_offset = _reference(tokens, seek, num_frames)
        segments, offset = split_window(tokens, seek, num_frames, BEGIN, input_stride=2)
        assert [(s.start, s.end, s.token_ids) for s in segments] == expected_segments, tokens
        assert offset == expected_offset
        assert all(s.seek == seek for s in segments)
        kinds.add((len(segments) > 1, offset == num_frames))
    assert len(kinds) >= 3


def test_window_without_timestamps_ends_where_transformers_computes_it():
    """The no-timestamp end is computed in float32 there (frames * 0.01 / 0.02, truncated)."""
    for num_frames in range(1, 3001):
        expected, _ = _reference([5, 6], 6000, num_frames)
        segments, offset = split_window([5, 6], 6000, num_frames, BEGIN, input_stride=2)
        assert (segments[0].start, segments[0].end) == expected[0][:2]
        assert offset == num_frames


def test_empty_window_is_one_empty_segment():
    segments, offset = split_window([], 3000, 3000, BEGIN, input_stride=2)
    assert [(s.start, s.end, s.token_ids) for s in segments] == [(30.0, 60.0, [])] and offset == 3000
