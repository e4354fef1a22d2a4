"""Structured output in the worker: one llguidance matcher per constrained request, advanced by every
token the request takes, and a vocabulary bitmask per step that the sampler applies to the batch.

The matcher lives here because the next step's mask depends on the token just sampled: only the
process that samples can compute it without a round trip. Grammars were validated by the frontend
against the same tokenizer, so building one here does not fail for a user's mistake.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from crane_mp.gguf_file import ModelSource
from crane_mp.model_tokenizer import grammar_tokenizer, source_tokenizer
from crane_mp.worker.host_buffers import device_longs
from crane_mp.worker.platforms import Platform

log = logging.getLogger("crane_mp.worker")

# Pristine matchers kept per grammar text; a request gets a copy (construction is the costly part).
_CACHED_GRAMMARS = 256
# A forbidden token's logit: finite, so the penalty adds (0 * inf would be NaN), yet so low that its
# probability is exactly 0 and it stays far below every allowed token after temperature and penalties.
_FORBIDDEN = 1e30


class GrammarEngine:
    """Matchers for constrained requests. The tokenizer view is built on the first one (a second or so
    for a 150k vocabulary, once per server), so servers that never constrain never pay for it."""

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: list[int], platform: Platform) -> None:
        self.source = source  # as the worker resolved it for the weights: the tokenizer comes from the same place
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.platform = platform
        self.device = device = platform.device
        self._tokenizer = None
        self._executor = None
        self._pristine: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the cache is filled by the preparing thread, read by the step loop
        self._bits = torch.arange(32, dtype=torch.int32, device=device)

    def prepare(self, grammar: str) -> None:
        """Build the grammar's pristine matcher into the cache (ValueError for an invalid one). Called
        off the step loop (PrepareGrammar): construction is what costs, up to a second for a large
        schema, and llguidance releases the GIL meanwhile."""
        self._pristine_matcher(grammar)

    def new_matcher(self, grammar: str):
        """A request's own matcher: a copy of the prepared one (built here only if it was evicted
        from the cache since, or on the in-process engine's path)."""
        return self._pristine_matcher(grammar).deep_copy()

    def _pristine_matcher(self, grammar: str):
        import llguidance

        with self._lock:
            pristine = self._pristine.get(grammar)
            if pristine is not None:
                self._pristine.move_to_end(grammar)
                return pristine
            if self._tokenizer is None:
                log.info("loading the tokenizer for structured output (once)")
                hf_tokenizer = source_tokenizer(self.source)
                self._tokenizer = grammar_tokenizer(hf_tokenizer, self.vocab_size, self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
        pristine = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ValueError(f"invalid grammar: {pristine.get_error()}")
        with self._lock:
            self._pristine[grammar] = pristine
            if len(self._pristine) > _CACHED_GRAMMARS:
                self._pristine.popitem(last=False)
        return pristine

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Push every token the grammar forbids in `rows` of `logits` [N, vocab] far below any allowed
        one: the masks are filled in parallel (llguidance's thread pool), unpacked, and added to the
        batch in one step. An additive penalty, not masked_fill: on CPU masked_fill runs ~10x slower
        (20 ms for 32 rows of a 150k vocabulary). Not through llguidance.torch either: its
        torch.compile'd kernel costs seconds of import and a compiler on CPU."""
        words = (self.vocab_size + 31) // 32
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
