"""How far each decode row speculates (ScheduledRequest.num_lookahead), and the acceptance counters.

The worker proposes and verifies (worker/speculative/); the scheduler only grants the lookahead, holds
its KV blocks, and turns it down where it does not pay: for every request while more than
`disable_batch_size` run (a large batch is no longer bound by reading the weights), and per request
after proposals the model rejected outright, waiting 4 steps after the first such miss and twice as
many after each next one (up to `_MAX_WAIT` steps) before it tries again, so a draft that never agrees
costs a fraction of a step's work in every few dozen steps. A request speculates again at the full
length once a proposal is accepted whole; one that had nothing to propose (no n-gram matched) looks
again `_EMPTY_WAIT` steps on. Steps are planned ahead of the one in flight (overlap) only while no
running request may speculate in the next one, so the requests that wait keep the overlap's gain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crane_mp.protocol import DraftOutcome

_MAX_WAIT = 64
_EMPTY_WAIT = 4


@dataclass(slots=True)
class DraftPace:
    """One request's speculation: tokens it may propose next, and steps left before it tries again."""

    length: int
    wait: int = 0
    misses: int = 0


@dataclass(slots=True)
class SpecCounters:
    drafts: int = 0  # steps of a request that proposed at least one token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculation:
    def __init__(self, num_tokens: int, disable_batch_size: int) -> None:
        self.num_tokens = num_tokens
        self.disable_batch_size = disable_batch_size
        self.counters = SpecCounters(accepted_per_position=[0] * num_tokens)
        self.paces: dict[int, DraftPace] = {}

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def lookahead(self, req_id: int, room: int, num_running: int) -> int:
        """Tokens request `req_id` may propose this step; `room`: how many more it may still produce
        beyond this step's one (max_tokens, the context window)."""
        if not self.enabled or num_running > self.disable_batch_size or room <= 0:
            return 0
        pace = self.paces.setdefault(req_id, DraftPace(self.num_tokens))
        return 0 if pace.wait else min(pace.length, room)

    def decoded_without(self, req_id: int) -> None:
        """The request decoded a step without speculating: one step less to wait."""
        pace = self.paces.get(req_id)
        if pace is not None and pace.wait:
            pace.wait -= 1

    def may_speculate(self, req_id: int) -> bool:
        """The request may propose tokens in its next step (it is not waiting after misses)."""
        pace = self.paces.get(req_id)
        return pace is None or not pace.wait

    def observe(self, outcome: DraftOutcome) -> None:
        """A speculating step came back: count it, and set how the request speculates next."""
        pace = self.paces.get(outcome.req_id)
        if outcome.proposed <= 0:  # nothing to propose: look again a few steps on
            if pace is not None:
                pace.wait = _EMPTY_WAIT
            return
        counters = self.counters
        counters.drafts += 1
        counters.draft_tokens += outcome.proposed
        counters.accepted_tokens += outcome.accepted
        for position in range(min(outcome.accepted, self.num_tokens)):
            counters.accepted_per_position[position] += 1
        if pace is None:
            return
        if outcome.accepted == 0:
            pace.misses += 1
            pace.wait = min(_MAX_WAIT, 2 ** (pace.misses + 1))
        else:
            pace.misses = 0
        # Propose one more than was accepted (all when all was): verifying rejected tokens costs work.
        pace.length = self.num_tokens if outcome.accepted == outcome.proposed else max(1, outcome.accepted + 1)

    def forget(self, req_id: int) -> None:
        self.paces.pop(req_id, None)
