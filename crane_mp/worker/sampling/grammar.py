"""Structured output in the worker: one llguidance matcher per constrained request, advanced by every
token the request takes, and a vocabulary bitmask per step that the sampler applies to the batch.

The matcher lives here because the next step's mask depends on the token just sampled: only the
process that samples can compute it without a round trip. Grammars were validated by the frontend
against the same tokenizer, so building one here does not fail for a user's mistake.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from crane_mp.model_tokenizer import grammar_tokenizer, source_tokenizer
from crane_mp.models.gguf_file import ModelSource
from crane_mp.worker.platforms import Platform
from crane_mp.worker.step.host_buffers import device_longs

# Pristine matchers kept per grammar text for the requests that repeat it (construction is the costly
# part; a request gets a copy). A grammar is kept from its second build on (a stream of one-off schemas
# keeps nothing), within a bound on the grammars' text: a matcher takes some 70 times its text in memory
# (14 MB for a 200 KB schema), so 256 KiB of text keeps the few large schemas a service repeats (an
# agent's tool list), or a hundred small ones.
_CACHED_GRAMMARS = 256
_CACHED_GRAMMAR_BYTES = 256 << 10
_REMEMBERED_GRAMMARS = 4096  # hashes of grammars built once, to notice the second build
# A forbidden token's logit: finite, so the penalty adds (0 * inf would be NaN), yet so low that its
# probability is exactly 0 and it stays far below every allowed token after temperature and penalties.
_FORBIDDEN = 1e30
# What a completion path (closing_path) tries first, in order: end a string, an object, an array; the
# shortest value; the separator that moves on to a property still required. A quote that would open a
# string (a letter may follow it) yields to a bracket that ends its array or object.
_CLOSERS = ('"', "}", "]", "0", ",")
_LETTER = "a"
# A walk that takes one token this many times running is lost in free text none of _CLOSERS ends (an
# XML parameter's value, say): it stops there.
_WALK_REPEATS = 64
# The tokens that lengthen a completion path most (a property, an object, an array, a string opened).
_OPENERS = (",", "{", "[", '"')
# Where a grammar may end but also go on (after a tool call: another call), the ways on are walked one
# by one up to this many; more is free text, which can end at any token.
_CONTINUATIONS = 8


class GrammarEngine:
    """Matchers for constrained requests, over llguidance's view of the vocabulary (load_vocabulary)."""

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: list[int], platform: Platform) -> None:
        self.source = source  # as the worker resolved it for the weights: the tokenizer comes from the same place
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.platform = platform
        self.device = device = platform.device
        self._tokenizer = None
        self._executor = None
        # Those of _CLOSERS, _OPENERS and _LETTER the vocabulary holds as one token: text -> id.
        self._closers: dict[str, int] = {}
        self._openers: dict[str, int] = {}
        self._letter: dict[str, int] = {}
        self._pristine: OrderedDict[str, object] = OrderedDict()
        self._cached_bytes = 0
        self._built_once: OrderedDict[int, None] = OrderedDict()
        # A prepared request's pristine matcher, held from PrepareGrammar until the request's own matcher
        # is made (or it ends unscheduled), whatever the cache has dropped since.
        self._prepared: dict[int, object] = {}
        self._lock = threading.Lock()  # the preparing thread fills both; the step loop reads them
        self._vocabulary_lock = threading.Lock()
        self._bits = torch.arange(32, dtype=torch.int32, device=device)

    def prepare(self, rid: int, grammar: str) -> None:
        """Build request `rid`'s pristine matcher, and its first mask, off the step loop (ValueError for an
        invalid grammar). Both are what costs, up to a second and 60 ms for a 200 KB schema; llguidance
        releases the GIL meanwhile, and a copy inherits the warmed lexer."""
        pristine = self._pristine_matcher(grammar)
        with self._lock:
            self._prepared[rid] = pristine

    def new_matcher(self, rid: int | None, grammar: str):
        """Request `rid`'s own matcher: a copy of its prepared one (built here only on a path that did
        not prepare it: rid None, or a test's)."""
        with self._lock:
            pristine = self._prepared.pop(rid, None) if rid is not None else None
        if pristine is None:
            pristine = self._pristine_matcher(grammar)
        return pristine.deep_copy()

    def forget(self, rid: int) -> None:
        """The request ended before its matcher was made: its prepared one is not needed."""
        with self._lock:
            self._prepared.pop(rid, None)

    def _pristine_matcher(self, grammar: str):
        import llguidance

        with self._lock:
            pristine = self._pristine.get(grammar)
            if pristine is not None:
                self._pristine.move_to_end(grammar)
                return pristine
        self.load_vocabulary()
        pristine = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ValueError(f"invalid grammar: {pristine.get_error()}")
        # Warmed before anyone else sees it (a matcher is not to be used by two threads at once).
        pristine.compute_bitmask()
        with self._lock:
            if self._built_before(grammar) and len(grammar) <= _CACHED_GRAMMAR_BYTES:
                self._cache(grammar, pristine)
        return pristine

    def load_vocabulary(self) -> None:
        """Build llguidance's view of the vocabulary, once (a second for 150k tokens): the worker starts
        it beside the step loop as soon as it is ready, so that the first constrained request does not
        wait for it."""
        import llguidance

        with self._vocabulary_lock:
            if self._tokenizer is None:
                hf_tokenizer = source_tokenizer(self.source)
                tokenizer = grammar_tokenizer(hf_tokenizer, self.vocab_size, self.eos_token_ids)
                self._closers = _single_tokens(tokenizer, _CLOSERS)
                self._openers = _single_tokens(tokenizer, _OPENERS)
                self._letter = _single_tokens(tokenizer, (_LETTER,))
                self._executor = llguidance.LLExecutor()
                self._tokenizer = tokenizer

    def _built_before(self, grammar: str) -> bool:
        key = hash(grammar)
        if key in self._built_once:
            return True
        self._built_once[key] = None
        if len(self._built_once) > _REMEMBERED_GRAMMARS:
            self._built_once.popitem(last=False)
        return False

    def _cache(self, grammar: str, pristine) -> None:
        if grammar in self._pristine:  # built twice at once (the step loop and the preparing thread)
            return
        self._pristine[grammar] = pristine
        self._cached_bytes += len(grammar)
        while self._cached_bytes > _CACHED_GRAMMAR_BYTES or len(self._pristine) > _CACHED_GRAMMARS:
            evicted, _ = self._pristine.popitem(last=False)
            self._cached_bytes -= len(evicted)

    def closing_path(self, matcher, limit: int) -> list[int] | None:
        """Tokens that take `matcher` from its state to one where its grammar may end, or None when
        none were found within `limit` tokens (or the walk ran in place). Short, not shortest: a
        greedy walk that takes a forced token where there is one, else the first of _CLOSERS the
        grammar allows, else its lowest allowed id (single bytes, in byte-level vocabularies). Some
        ten microseconds a token; the matcher is left as it was."""
        if matcher.is_error():
            return None
        path: list[int] = []
        running = 0  # how many times running the walk took its last token
        try:
            while not matcher.is_accepting():
                if len(path) >= limit or running >= _WALK_REPEATS:
                    return None
                token = self._closing_step(matcher)
                if token is None or not matcher.consume_token(token):
                    return None
                running = running + 1 if path and path[-1] == token else 1
                path.append(token)
            return path
        finally:
            matcher.rollback(len(path))

    def longest_after_opening(self, matcher, limit: int) -> int:
        """The longest completion, counting the token, after one of _OPENERS the grammar allows now
        (0 if none is), or limit + 1 where one does not end within `limit` tokens: what the next free
        token could cost (0 inside free text, a letter allowed: there they are text). The matcher is left
        as it was."""
        if self._letter and matcher.validate_tokens([self._letter[_LETTER]]) == 1:
            return 0
        longest = 0
        for token in self._openers.values():
            if matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
                continue
            path = self.closing_path(matcher, limit - 1)
            matcher.rollback(1)
            longest = max(longest, limit + 1 if path is None else 1 + len(path))
        return longest

    def shortest_continuation(self, matcher, limit: int) -> int | None:
        """From a state where the grammar may end: the fewest tokens, counting the first, in which it can
        go on (a token it allows besides EOS) and reach an end again; None where that is not known: more
        ways on than _CONTINUATIONS (free text), or one whose walk found no end within `limit` tokens.
        The matcher is left as it was."""
        if self._letter and matcher.validate_tokens([self._letter[_LETTER]]) == 1:
            return None
        bitmask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        words = np.flatnonzero(bitmask)
        if len(words) > _CONTINUATIONS + len(self.eos_token_ids):
            return None
        tokens = [int(word) * 8 + bit for word in words for bit in range(8) if bitmask[word] >> bit & 1]
        tokens = [token for token in tokens if token not in self.eos_token_ids]
        if len(tokens) > _CONTINUATIONS:
            return None
        shortest = None
        for token in tokens:
            if not matcher.consume_token(token):
                continue
            path = self.closing_path(matcher, limit - 1)
            matcher.rollback(1)
            if path is None:
                return None
            shortest = 1 + len(path) if shortest is None else min(shortest, 1 + len(path))
        return shortest

    def _closing_step(self, matcher) -> int | None:
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        allowed = [text for text, token in self._closers.items() if matcher.validate_tokens([token]) == 1]
        if allowed[:1] == ['"'] and len(allowed) > 1 and allowed[1] in ("}", "]") and self._letter \
                and matcher.validate_tokens([self._closers['"'], self._letter[_LETTER]]) == 2:
            return self._closers[allowed[1]]  # a bracket, not a quote that would open a string
        if allowed:
            return self._closers[allowed[0]]
        bitmask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        words = np.flatnonzero(bitmask)
        if not len(words):
            return None
        bits = int(bitmask[words[0]])
        return int(words[0]) * 8 + (bits & -bits).bit_length() - 1

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Push every token the grammar forbids in `rows` of `logits` [N, vocab] far below any allowed
        one: the masks are filled in parallel (llguidance's thread pool), unpacked, and added to the
        batch in one step. An additive penalty, not masked_fill: on CPU masked_fill runs ~10x slower
        (20 ms for 32 rows of a 150k vocabulary). Not through llguidance.torch either: its
        torch.compile'd kernel costs seconds of import and a compiler on CPU."""
        words = (self._tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=self.platform.pinned)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                               words * 4, len(rows))
        width = logits.shape[1]
        if self.platform.on_cpu:  # the logits are on the host: unpack there
            allowed = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=width,
                                                     bitorder="little"))
        else:
            bitmask = bitmask.to(self.device, non_blocking=True)
            allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).view(len(rows), -1)[:, :width]
        penalty = allowed.float().sub_(1.0).mul_(_FORBIDDEN)  # 0 where allowed
        if len(rows) == logits.shape[0]:
            logits.add_(penalty)
        else:
            logits.index_add_(0, device_longs(rows, self.device), penalty)


def _single_tokens(tokenizer, texts: tuple[str, ...]) -> dict[str, int]:
    """text -> id of those texts the vocabulary holds as one token, in order."""
    ids = {text: tokenizer.tokenize_str(text) for text in texts}
    return {text: one[0] for text, one in ids.items() if len(one) == 1}
