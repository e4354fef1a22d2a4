"""Incremental detokenization with stop strings, per request.

DecodeStream (from `tokenizers`), primed with the prompt, turns token ids into text correctly across
multi-byte UTF-8 characters split over tokens. While streaming, the last max(len(stop)) - 1
characters are held back so a partial stop string never reaches the client; they are flushed at the end.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, backend, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True) -> None:
        self.backend = backend
        self.stream = DecodeStream(ids=prompt_ids[-8:], skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far (up to a stop string)
        self.num_sent = 0  # characters already returned to the caller
        self.matched_stop: str | None = None
        self.num_tokens = 0  # tokens consumed (they stop counting at a matched stop string)
        self.token_ids: list[int] = []
        self.skip_special_tokens = skip_special_tokens

    def add(self, token_ids: list[int]) -> str:
        """Decode new tokens; returns the text safe to send now.

        When a stop string completes, sets `matched_stop`, drops the text from the match on and stops
        consuming: `num_tokens` then counts the tokens up to the one that completed it.
        """
        if self.matched_stop is not None:
            return ""
        for token_id in token_ids:
            start = len(self.text)
            piece = self.stream.step(self.backend, token_id)
            self.num_tokens += 1
            self.token_ids.append(token_id)
            if piece:
                self.text += piece
                if self.stop and self._find_stop(start):
                    return self.flush()
        safe = len(self.text) - self.holdback
        if safe <= self.num_sent:
            return ""
        chunk = self.text[self.num_sent : safe]
        self.num_sent = safe
        return chunk

    def finish(self) -> str:
        """At the end of a request: the rest of the text, including bytes of a character the output
        never completed, which a full decode renders as U+FFFD (DecodeStream keeps waiting for them)."""
        if self.matched_stop is None:
            full = self.backend.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            if full.startswith(self.text):
                self.text = full
        return self.flush()

    def flush(self) -> str:
        chunk = self.text[self.num_sent :]
        self.num_sent = len(self.text)
        return chunk

    def _find_stop(self, start: int) -> bool:
        # A stop string completed by the new piece starts at most len(stop) - 1 characters before it.
        best = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.matched_stop = best[1]
        return True
