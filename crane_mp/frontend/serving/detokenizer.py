"""Incremental detokenization with stop strings, per request.

DecodeStream (from `tokenizers`), primed with the prompt, turns token ids into text correctly across
multi-byte UTF-8 characters split over tokens. While streaming, the last max(len(stop)) - 1
characters are held back so a partial stop string never reaches the client; they are flushed at the end.
`skip_ids` drops those tokens and keeps every other special token's text: an answer read for marks
that are special tokens (Gemma 4's tool calls) keeps them, and only them.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, backend, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 skip_ids: frozenset[int] | None = None) -> None:
        self.backend = backend
        self.skip_ids = skip_ids if skip_special_tokens else None
        if self.skip_ids is not None:
            skip_special_tokens = False
        self.stream = DecodeStream(ids=prompt_ids[-8:], skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        # The text so far (up to a stop string) is `sent` joined, then `pending`: only the short unsent
        # tail is ever rebuilt, so a long output costs linear time (a growing string appended to per
        # token copies everything before it each time).
        self.sent: list[str] = []
        self.pending = ""
        self.matched_stop: str | None = None
        self.num_tokens = 0  # tokens consumed (they stop counting at a matched stop string)
        self.token_ids: list[int] = []
        self.skip_special_tokens = skip_special_tokens  # as the stream decodes

    @property
    def text(self) -> str:
        """Everything decoded so far (up to a stop string)."""
        return "".join(self.sent) + self.pending

    def add(self, token_ids: list[int]) -> str:
        """Decode new tokens; returns the text safe to send now.

        When a stop string completes, sets `matched_stop`, drops the text from the match on and stops
        consuming: `num_tokens` then counts the tokens up to the one that completed it.
        """
        if self.matched_stop is not None:
            return ""
        # A local string with no other reference grows in place; the attribute is set once at the end.
        pending, self.pending = self.pending, ""
        for token_id in token_ids:
            start = len(pending)
            self.num_tokens += 1
            self.token_ids.append(token_id)
            if self.skip_ids is not None and token_id in self.skip_ids:
                continue
            piece = self.stream.step(self.backend, token_id)
            if piece:
                pending += piece
                if self.stop and self._find_stop(pending, start):
                    return self.flush()
        self.pending = pending
        safe = len(pending) - self.holdback
        if safe <= 0:
            return ""
        return self._send(safe)

    def finish(self) -> str:
        """At the end of a request: the rest of the text, including bytes of a character the output
        never completed, which a full decode renders as U+FFFD (DecodeStream keeps waiting for them)."""
        if self.matched_stop is None:
            ids = self.token_ids if self.skip_ids is None else [i for i in self.token_ids if i not in self.skip_ids]
            full = self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
            text = self.text
            if full.startswith(text):
                self.pending += full[len(text):]
        return self.flush()

    def flush(self) -> str:
        return self._send(len(self.pending))

    def _send(self, count: int) -> str:
        chunk, self.pending = self.pending[:count], self.pending[count:]
        self.sent.append(chunk)
        return chunk

    def _find_stop(self, pending: str, start: int) -> bool:
        """Whether a stop string ends in the piece added at `start` of `pending` (the unsent text, which
        holds at least the holdback's characters before the piece); if so, `pending` is kept up to it.
        Such a match starts at most len(stop) - 1 characters before the piece."""
        best = None
        for stop in self.stop:
            index = pending.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.pending = pending[: best[0]]
        self.matched_stop = best[1]
        return True
