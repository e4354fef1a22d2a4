"""One decoded Whisper window -> its timed segments and how far the next window starts, as transformers'
`_retrieve_segment` splits it (same arithmetic, so the same float seconds). No torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TIME_PRECISION = 0.02  # seconds per timestamp token step
_FRAME_SECONDS = np.float32(0.01)  # seconds per mel frame, as transformers computes it (float32)


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of the transcript between timestamps. `token_ids` as transformers' segments hold them:
    timestamp tokens included, EOS not. `seek`: the first mel frame of the window it came from."""

    seek: int
    start: float
    end: float
    token_ids: list[int]
    temperature: float = 0.0
    avg_logprob: float | None = None  # over the window's sampled tokens, when the decoder reported logprobs


def split_window(token_ids: list[int], seek: int, num_frames: int, timestamp_begin: int,
                 input_stride: int) -> tuple[list[Segment], int]:
    """The segments of one window's generated tokens (trailing EOS removed) and the number of mel
    frames to advance `seek` by. `num_frames`: the window's frames before padding to 30 s.

    Consecutive timestamps close a segment. When the window ends in a lone timestamp (nothing was
    being said after it), the next window starts after this one; otherwise the unfinished tail is
    dropped and the next window starts at the last closing timestamp. Without a closing pair the
    whole window is one segment."""
    time_offset = seek * TIME_PRECISION / input_stride
    is_timestamp = [token >= timestamp_begin for token in token_ids]
    single_timestamp_ending = is_timestamp[-2:] == [False, True]
    # Indices where a segment ends: between the two timestamps of each pair.
    cuts = [i + 1 for i in range(len(is_timestamp) - 1) if is_timestamp[i] and is_timestamp[i + 1]]
    if not cuts:
        timestamps = [token for token in token_ids if token >= timestamp_begin]
        last_position = int(np.float32(num_frames) * _FRAME_SECONDS / np.float32(TIME_PRECISION))
        if timestamps and timestamps[-1] != timestamp_begin:
            last_position = timestamps[-1] - timestamp_begin
        end = time_offset + last_position * TIME_PRECISION
        return [Segment(seek, time_offset, end, list(token_ids))], num_frames
    if single_timestamp_ending:
        cuts.append(len(token_ids))
    else:
        cuts[-1] += 1  # the last segment keeps both timestamps of its closing pair
    segments, first = [], 0
    for i, cut in enumerate(cuts):
        tokens = token_ids[first:cut]
        closing = -2 if i == len(cuts) - 1 and not single_timestamp_ending else -1
        start = time_offset + (tokens[0] - timestamp_begin) * TIME_PRECISION
        end = time_offset + (tokens[closing] - timestamp_begin) * TIME_PRECISION
        segments.append(Segment(seek, start, end, tokens))
        first = cut
    if single_timestamp_ending:
        return segments, num_frames
    return segments, (token_ids[first - 2] - timestamp_begin) * input_stride
