"""Prompt lookup: the tokens that followed the latest earlier occurrence of a request's last tokens.

No second model: agents, code editors and summaries repeat their inputs, and a copy of what followed
the same few tokens before is often what comes next."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], max_tokens: int, min_match: int, max_match: int) -> list[int]:
    """Up to `max_tokens` tokens: those after the latest earlier match of the last n tokens, trying the
    longest n (at most `max_match`) first and none shorter than `min_match`; [] when nothing matches."""
    length = len(token_ids)
    if max_tokens <= 0 or length <= min_match:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_match, length - 1), min_match - 1, -1):
        # Windows starting before the suffix itself: each start s matches tokens[s : s + n].
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + max_tokens]
    return []


class NgramProposer:
    """Proposals from each request's own tokens; it keeps no state of its own."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def propose(self, batch: list[tuple[int, list[int], list[int], int]]) -> dict[int, list[int]]:
        """batch: (req id, token ids, block table, tokens wanted) per speculating request."""
        return {req_id: propose_ngram(tokens, wanted, self.min_match, self.max_match)
                for req_id, tokens, _, wanted in batch}

    def accepted(self, req_id: int, num_known: int, proposed: int, accepted: int) -> None:
        """The target kept `accepted` of the proposals after `num_known` tokens."""

    def reset(self, req_id: int) -> None:
        """The request's KV is recomputed from its first token (preempted)."""

    def forget(self, req_id: int) -> None:
        """The request finished."""
