"""Continuous batching under a KV-block budget: admission, prefix caching, chunked prefill, preemption
with lossless resume, and planning one step ahead of the results (overlap).

Driven by its owner (the scheduler process, or the in-process engine): `add_request` / `abort_request`
as messages arrive, `schedule()` once per step, `update()` with the worker's `StepResult`. With
overlap the owner plans step N+1 before step N's result arrives: a request whose planned span ends
its known tokens has a token "pending", the worker feeds that token itself, and a request that turns
out to have finished in step N wastes one row of step N+1, which is dropped here.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from crane_mp.config import EngineConfig
from crane_mp.models.kv_groups import FULL, first_live_block, sequence_blocks
from crane_mp.protocol import ErrorKind, FinishReason, NewRequest, ScheduledRequest, StepPlan, StepResult, TokenOutput
from crane_mp.scheduler.block_pool import BlockPool, chain_keys
from crane_mp.scheduler.pacing import SHORT_QUEUE_TOKENS, PrefillPace
from crane_mp.scheduler.request import Request, RequestStatus
from crane_mp.scheduler.speculation import Speculation
from crane_mp.scheduler.step_clock import StepClock


class RequestRejected(ValueError):
    """The request can never run (too long for the context window or the KV cache)."""

    kind = ErrorKind.INVALID


class QueueFull(RequestRejected):
    """--max-queue requests already wait: the client should retry later or elsewhere."""

    kind = ErrorKind.OVERLOADED


# Root of every request's block-key chain; adapters or models that must never share KV get their own.
_BASE_MODEL_ROOT = hash(("crane-mp", "base"))


def _chain_root(req: Request) -> int:
    """Where a request's block-key chain starts: KV computed under one adapter is never found by another,
    nor KV computed against one audio clip (every decoder position attends to it) by another clip's."""
    lora_id = req.sampling.lora_id
    root = _BASE_MODEL_ROOT if lora_id == 0 else hash(("crane-mp", "lora", lora_id))
    for item in req.media:
        if not item.num_tokens:
            root = hash((root, item.kind, item.key))
    return root


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    enable_prefix_caching: bool = True
    # Reuse touched KV memory before never-used blocks (CPU: first touches are slow; block_pool.py).
    warm_blocks_first: bool = False
    max_queue: int | None = None  # requests waiting for a running slot beyond which new ones are refused
    lora_modules: tuple[tuple[str, str], ...] = ()  # the adapters loaded at start (ids 1, 2, ...)
    max_loras: int = 8
    # Prompt tokens per step are paced to about this many seconds (pacing.py); 0: only the token budget.
    prefill_step_seconds: float = 0.0
    prefill_seconds_per_token: float = 0.0  # the pace's first estimate (the worker's warm-up)
    # With a step in flight the next is planned this far through it (step_clock.py); 0: at once.
    plan_ahead_fraction: float = 0.0
    # An encoder's prompts attend to all of themselves: each is computed whole in one step (beyond the
    # token budget if it must, when it is the step's first), and none is served from the prefix cache.
    whole_prompts: bool = False
    # Per KV group (models/kv_groups.py): FULL, or the window of its sliding layers, whose blocks before
    # a sequence's window go back to the pool.
    kv_windows: tuple[int, ...] = (FULL,)
    # An image's placeholders attend to each other both ways (Gemma 3): a step computes all of them or
    # none, and a prefix-cache hit never ends among them.
    whole_images: bool = False
    # Sleep (residency.py): after this many idle seconds (0: only when asked), to this level.
    sleep_idle_seconds: float = 0.0
    sleep_level: int = 1
    weights_path: str = ""  # the weights served at start
    # Speculative decoding (speculation.py): tokens a decode row may propose (0: off), and the running
    # requests beyond which none does.
    num_speculative_tokens: int = 0
    speculative_disable_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.num_blocks < self.sequence_blocks(self.max_model_len):
            raise ValueError("the KV cache must hold at least one max_model_len sequence")

    def sequence_blocks(self, num_tokens: int) -> int:
        return sequence_blocks(self.kv_windows, num_tokens, self.block_size, self.max_num_batched_tokens)


# A CPU step's share of prompt work: long enough that weights streamed per step stay a small part of
# it (0.2 s at 8B on two cores), short enough that a burst's first request streams within seconds.
CPU_PREFILL_STEP_SECONDS = 3.0
# Late enough that a request arriving as a step starts (a client answering the last token) joins the
# next one; early enough that a step ending sooner than expected rarely leaves the worker waiting.
CPU_PLAN_AHEAD_FRACTION = 0.75


def scheduler_config(
    engine: EngineConfig, num_blocks: int, max_model_len: int, eos_token_ids: tuple[int, ...], on_cpu: bool,
    max_queue: int | None = None, prefill_seconds_per_token: float = 0.0, whole_prompts: bool = False,
    kv_windows: tuple[int, ...] = (FULL,), state_slots: int = 0, whole_images: bool = False,
) -> SchedulerConfig:
    """The scheduler's config from the engine's and the facts the worker reported at start-up.

    `state_slots`: a hybrid model's state pool (0: none). No more sequences run at once than it holds,
    and the prefix cache is off: a cached prefix's KV would skip the linear-attention layers, whose
    state at the prefix's end is not kept."""
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=engine.block_size,
        max_num_seqs=min(engine.max_num_seqs, state_slots) if state_slots else engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=tuple(eos_token_ids),
        enable_prefix_caching=engine.enable_prefix_caching and not whole_prompts and not state_slots,
        warm_blocks_first=on_cpu,
        lora_modules=engine.lora_modules,
        max_loras=engine.max_loras,
        max_queue=max_queue,
        prefill_step_seconds=CPU_PREFILL_STEP_SECONDS if on_cpu else 0.0,
        prefill_seconds_per_token=prefill_seconds_per_token,
        plan_ahead_fraction=CPU_PLAN_AHEAD_FRACTION if on_cpu else 0.0,
        whole_prompts=whole_prompts,
        kv_windows=tuple(kv_windows),
        whole_images=whole_images,
        sleep_idle_seconds=engine.sleep_idle_seconds,
        sleep_level=engine.sleep_level,
        weights_path=engine.model_path,
        num_speculative_tokens=engine.speculative_num_tokens if engine.speculative_method else 0,
        speculative_disable_batch_size=engine.speculative_disable_batch_size,
    )


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _group_key(group: int, key: int) -> int:
    """A block's prefix-cache key in KV group `group`: the groups hold different layers of one prefix."""
    return key if group == 0 else hash((key, group))


def _decodes(req: Request, num_tokens: int) -> bool:
    """The step computes `req`'s one newest token (a decode row), not a chunk of its prompt."""
    return num_tokens == 1 and req.num_computed_tokens + 1 == req.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching, config.warm_blocks_first)
        # A sliding group's table entry before its window: the block past the pool's (the worker's spare).
        self.no_block = config.num_blocks
        self.windows = config.kv_windows
        self.sliding = any(window != FULL for window in self.windows)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Effective concurrency cap: lowered on preemption, raised again as requests finish.
        self.max_running = config.max_num_seqs
        # Keep a few blocks spare at admission so running decodes rarely need to preempt.
        self.watermark_blocks = max(1, config.num_blocks // 100)
        self._step_id = 0
        self._finished_for_worker: list[int] = []
        self.pace = PrefillPace(config.prefill_step_seconds, config.prefill_seconds_per_token)
        self.clock = StepClock(config.plan_ahead_fraction)
        self._prompt_tokens: dict[int, int] = {}  # step id -> prompt tokens planned, until its result
        self._num_registered: dict[int, int] = {}  # req id -> leading blocks already in the cache
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found
        # New weights wait to be swapped in: no request starts, the ones started finish (residency.py).
        self.hold_new = False
        self.spec = Speculation(config.num_speculative_tokens, config.speculative_disable_batch_size)
        # Requests whose speculating step has not come back: how many tokens it gains is unknown until
        # then, so none is planned again before (and no step is planned ahead meanwhile: `speculating`).
        self.awaiting_drafts: set[int] = set()

    # ---- intake ---------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        limit = self.config.max_model_len
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        if req.num_prompt_tokens + req.sampling.max_tokens > limit:
            raise RequestRejected(
                f"this model's maximum context length is {limit} tokens, but {req.num_prompt_tokens} prompt "
                f"tokens + {req.sampling.max_tokens} max tokens were requested"
            )
        if req.req_id in self.requests:
            raise RequestRejected(f"request id {req.req_id} is already in use")
        longest = max((item.num_tokens for item in req.media), default=0)
        if self.config.whole_images and longest > self.config.max_num_batched_tokens:
            raise RequestRejected(f"an image of {longest} tokens is longer than a step's token budget "
                                  f"(--max-num-batched-tokens {self.config.max_num_batched_tokens}), and its "
                                  "tokens must be computed in one step")
        if self.config.max_queue is not None:
            # Requests a free running slot will take at once do not wait: they do not count.
            free_slots = max(0, self.max_running - len(self.running))
            if len(self.waiting) >= self.config.max_queue + free_slots:
                raise QueueFull(f"the server is overloaded: {len(self.waiting)} requests are already waiting "
                                "(--max-queue); retry later")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: int) -> TokenOutput | None:
        """Finish a request with ABORT wherever it is; unknown or finished ids are ignored."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return self._output(req, finish_reason=FinishReason.ABORT)

    def fail_request(self, req_id: int, message: str) -> TokenOutput | None:
        """Finish a request whose processing raised, with ERROR. The blocks it computed itself leave the
        prefix cache (with overlap some were registered while the failed step ran: half written); the
        ones it found cached were computed by others and stay."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        first = (req.num_cached_tokens or 0) // self.config.block_size
        self.pool.uncache(req.block_ids[first:])
        for group in range(1, len(self.windows)):  # blocks already released from a window too, by key
            self.pool.uncache_keys([_group_key(group, key) for key in req.block_keys[first:]])
        self._finish(req, FinishReason.ERROR, cache_blocks=False)
        out = self._output(req, finish_reason=FinishReason.ERROR)
        out.error, out.error_kind = message, ErrorKind.INTERNAL
        return out

    def forget_on_worker(self, req_id: int) -> None:
        """A request the worker prepared a grammar for ended before it was queued here: the next plan
        tells the worker to drop what it holds for it."""
        self._finished_for_worker.append(req_id)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while any request is queued or running."""
        if self.requests:
            return False
        self.pool.flush()
        return True

    # ---- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan one step; None when there is nothing to compute."""
        budget = self.config.max_num_batched_tokens
        # Paced only while others wait or stream (decode rows never are): a prompt alone goes at full speed.
        contended = len(self.running) + len(self.waiting) > 1
        prompt_budget = (self.pace.token_cap(self.config.block_size, self._pending_prompt_tokens())
                         if contended else None) or budget
        new_requests: list[NewRequest] = []
        scheduled: list[ScheduledRequest] = []
        preempted: list[int] = []
        prompt_tokens = 0  # planned so far (decode rows are not prompt work)
        if self.sliding:
            for req in self.running:
                self._release_behind_windows(req)

        def plan(req: Request, num_tokens: int, lookahead: int = 0) -> None:
            nonlocal prompt_tokens
            prompt_tokens += 0 if _decodes(req, num_tokens) else num_tokens
            new_blocks, group_blocks = self._grow_blocks(req, req.num_computed_tokens + num_tokens + lookahead)
            if not req.known_to_worker:
                new_requests.append(NewRequest(req.req_id, req.prompt_ids, req.sampling, req.media))
                # The worker has the pixels now (and keeps what it encodes through preemptions); the
                # prefix cache needs only each item's key, offset and length.
                req.media = [msgspec.structs.replace(item, values=b"") for item in req.media]
                req.known_to_worker = True
                req.queue_time = max(0.0, time.time() - req.arrival_time) if req.arrival_time else 0.0
            scheduled.append(ScheduledRequest(req.req_id, req.num_computed_tokens, num_tokens, new_blocks,
                                              req.blocks_reset, group_blocks, lookahead))
            if lookahead:
                self.awaiting_drafts.add(req.req_id)
            elif self.spec.enabled and _decodes(req, num_tokens):
                self.spec.decoded_without(req.req_id)
            req.blocks_reset = False
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens == req.num_tokens:
                req.num_pending += 1  # the worker samples the next token in this step

        running_plan = self._fit_running(budget, prompt_budget, preempted)
        if not any(_decodes(req, n) for req, n, _ in running_plan) and not (self.config.whole_prompts
                                                                             or self.config.whole_images):
            # No stream is decoding yet (an idle server, or only prefills): a first small chunk lets
            # the first requests start streaming after a quarter of a full step instead of after it,
            # where the first waiting prompt fits in it. One that does not would only be cut in two, the
            # second part's attention masked (a lone 2,000-token prompt's on an 8B took 1.5x as long).
            quarter = max(self.config.block_size, budget // 4)
            if self.waiting and self._tokens_to_compute(self.waiting[0]) <= quarter:
                budget = quarter
        for req, num_tokens, lookahead in running_plan:
            plan(req, num_tokens, lookahead)
            budget -= num_tokens + lookahead

        while self.waiting and min(budget, prompt_budget - prompt_tokens) > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.hold_new and not req.known_to_worker:
                break  # it starts on the new weights
            if not self._may_sample(req):
                break  # its last token is still coming back; it finishes on that update
            hits = self._cache_hits(req)
            num_cached = len(hits[0]) * self.config.block_size
            num_tokens = self._whole_images(req, num_cached, min(req.num_tokens - num_cached, budget,
                                                                 prompt_budget - prompt_tokens), budget)
            if num_tokens == 0:
                break  # an image the step has no room left for: the next step takes it whole
            if self.config.whole_prompts and num_tokens < req.num_tokens:
                if scheduled:
                    break  # the next step takes it whole
                num_tokens = req.num_tokens
            needed = (
                (_blocks_for(num_cached + num_tokens, self.config.block_size) - len(hits[0])) * len(self.windows)
                + sum(self.pool.num_evictable([b for b in table if b != self.no_block]) for table in hits)
            )
            reserve = self.watermark_blocks if self.running else 0
            if not self.pool.can_allocate(needed + reserve):
                break
            self.waiting.popleft()
            self._admit(req, hits)
            plan(req, num_tokens)
            budget -= num_tokens

        finished = self._finished_for_worker
        self._finished_for_worker = []
        if not scheduled and not finished and not preempted:
            return None
        self._step_id += 1
        self._prompt_tokens[self._step_id] = prompt_tokens
        return StepPlan(self._step_id, new_requests, scheduled, preempted, finished)

    def _pending_prompt_tokens(self) -> int:
        """Prompt tokens the running and waiting requests have left to compute, counted only up to just
        beyond what makes a short queue (pacing.py), however long the queue."""
        pending = 0
        for req in itertools.chain(self.running, self.waiting):
            pending += req.prompt_tokens_left
            if pending > SHORT_QUEUE_TOKENS:
                break
        return pending

    def plan_ahead_delay(self) -> float:
        """Seconds after the oldest step in flight started at which to plan the next (step_clock.py)."""
        if not self._prompt_tokens:
            return 0.0
        return self.clock.plan_delay(self._prompt_tokens[min(self._prompt_tokens)])

    def _may_sample(self, req: Request) -> bool:
        """Another token may be sampled: neither max_tokens nor the context window is reached, counting
        the pending ones."""
        return (
            len(req.output_ids) + req.num_pending < req.sampling.max_tokens
            and req.num_tokens < self.config.max_model_len
        )

    def _whole_images(self, req: Request, start: int, num_tokens: int, room: int) -> int:
        """`num_tokens` from position `start`, cut before the placeholders of an image they would split, or
        grown to the image's end (within `room`) when they start at it; 0: the image waits for room."""
        if not self.config.whole_images:
            return num_tokens
        end = start + num_tokens
        for item in req.media:
            first, last = item.offset, item.offset + item.num_tokens
            if first < end < last:
                if first > start:
                    return first - start
                return last - start if last - start <= room else 0
        return num_tokens

    def _before_images(self, req: Request, num_blocks: int) -> int:
        """A cached prefix of `num_blocks` blocks, cut to end before an image whose placeholders it would
        split (whole_images)."""
        inside = [item.offset for item in req.media if self.config.whole_images
                  and item.offset < num_blocks * self.config.block_size < item.offset + item.num_tokens]
        # Cut to a block boundary, which may fall inside an earlier image: again from there.
        return self._before_images(req, inside[0] // self.config.block_size) if inside else num_blocks

    def _tokens_to_compute(self, req: Request) -> int:
        """Tokens a waiting request has to compute beyond the cached blocks that start it."""
        return req.num_tokens - len(self._cache_hits(req)[0]) * self.config.block_size

    def _cache_hits(self, req: Request) -> list[list[int]]:
        """Per KV group, the cached blocks that start this request, leaving at least one token to compute
        (its logits); every group's list is as long. A sliding group needs only the blocks of the window
        before the first token computed, the rest of its list is `no_block`. Requests that score their
        prompt or pool more than its last position (mean, CLS) compute every position, so they look
        nothing up."""
        params = req.sampling
        if not self.pool.enable_caching or params.prompt_logprobs is not None or params.pools_prompt:
            return [[] for _ in self.windows]
        num_known = req.num_prompt_tokens + len(req.output_ids)
        limit = min(num_known, req.num_tokens - 1) // self.config.block_size
        self._extend_keys(req, limit)
        keys = req.block_keys[:limit]
        if len(self.windows) == 1 and not self.sliding:
            found = self.pool.lookup(keys)
            return [found[: self._before_images(req, len(found))]]
        for group, window in enumerate(self.windows):
            if window == FULL:
                limit = min(limit, len(self.pool.lookup([_group_key(group, key) for key in keys[:limit]])))
        size = self.config.block_size
        while limit > 0:  # the longest prefix every sliding group holds the window before of (and no image split)
            limit = self._before_images(req, limit)
            missing = None
            for group, window in enumerate(self.windows):
                if window == FULL:
                    continue
                for i in range(limit - 1, first_live_block(window, limit * size, size) - 1, -1):
                    if self.pool.cached_block(_group_key(group, keys[i])) is None:
                        missing = i
                        break
                if missing is not None:
                    break
            if missing is None:
                break
            limit = missing  # every longer prefix reads block `missing` in that group's window
        hits = []
        for group, window in enumerate(self.windows):
            start = first_live_block(window, limit * size, size)
            hits.append([self.no_block] * start
                        + [self.pool.cached_block(_group_key(group, key)) for key in keys[start:limit]])
        return hits

    def _extend_keys(self, req: Request, num_blocks: int) -> None:
        """Compute the keys of the request's first `num_blocks` blocks (all their tokens are known)."""
        have = len(req.block_keys)
        if num_blocks > have:
            parent = req.block_keys[-1] if have else _chain_root(req)
            req.block_keys += chain_keys(req.cache_key_ids, self.config.block_size, num_blocks, parent, start=have)

    def _admit(self, req: Request, hits: list[list[int]]) -> None:
        for table in hits:
            self.pool.take([block for block in table if block != self.no_block])
        req.block_ids, req.group_block_ids = hits[0], hits[1:]
        req.blocks_reset = True  # the worker gets the whole table: cached blocks first
        req.num_computed_tokens = len(hits[0]) * self.config.block_size
        req.window_start = [first_live_block(window, req.num_computed_tokens, self.config.block_size)
                            for window in self.windows]
        self._num_registered[req.req_id] = len(hits[0])
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _grow_blocks(self, req: Request, num_tokens: int) -> tuple[list[int], list[list[int]]]:
        """Blocks for the request's first `num_tokens` in every KV group: (group 0's, the others'), new
        ones only, or whole tables after a reset."""
        needed = _blocks_for(num_tokens, self.config.block_size) - len(req.block_ids)
        grown = []
        for table in self._tables(req):
            new_blocks = self.pool.allocate(needed) if needed > 0 else []
            table.extend(new_blocks)
            grown.append(list(table) if req.blocks_reset else new_blocks)
        return grown[0], grown[1:]

    def _tables(self, req: Request) -> list[list[int]]:
        return [req.block_ids, *req.group_block_ids]

    def _release_behind_windows(self, req: Request) -> None:
        """Give back each sliding group's blocks wholly before the window of the request's next query
        (the blocks of the steps already planned run before any step planned now), findable in the
        prefix cache first."""
        self._register_full_blocks(req)
        size = self.config.block_size
        for group, (window, table) in enumerate(zip(self.windows, self._tables(req))):
            end = min(first_live_block(window, req.num_computed_tokens, size), len(table))
            start = req.window_start[group]
            if end > start:
                self.pool.free([block for block in table[start:end] if block != self.no_block])
                table[start:end] = [self.no_block] * (end - start)
                req.window_start[group] = end

    def _running_demand(self, budget: int, prompt_budget: int) -> list[tuple[Request, int, int, int]]:
        """(request, tokens, lookahead, new blocks) for each running request this step; decodes first,
        then prefills (within `prompt_budget` too)."""
        demand = []
        for req in sorted(self.running, key=lambda r: r.prompt_tokens_left > 0):
            if req.req_id in self.awaiting_drafts:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            num_tokens = min(remaining, budget if remaining == 1 else min(budget, max(prompt_budget, 0)))
            num_tokens = self._whole_images(req, req.num_computed_tokens, num_tokens, budget)
            samples = req.num_computed_tokens + num_tokens == req.num_tokens
            if num_tokens == 0 or (samples and not self._may_sample(req)):
                continue
            lookahead = min(self._lookahead(req, num_tokens), budget - num_tokens)
            total = _blocks_for(req.num_computed_tokens + num_tokens + lookahead, self.config.block_size)
            # A request may hold blocks past its tokens already (an earlier step's rejected proposals).
            demand.append((req, num_tokens, lookahead, max(0, total - len(req.block_ids)) * len(self.windows)))
            budget -= num_tokens + lookahead
            prompt_budget -= 0 if _decodes(req, num_tokens) else num_tokens
        return demand

    def _lookahead(self, req: Request, num_tokens: int) -> int:
        """Tokens a decode row may propose beyond the one it samples: none for a row with a token still
        pending (its input is not known here yet)."""
        if not self.spec.enabled or not _decodes(req, num_tokens) or req.num_pending:
            return 0
        room = min(req.sampling.max_tokens - len(req.output_ids), self.config.max_model_len - req.num_tokens) - 1
        return self.spec.lookahead(req.req_id, room, len(self.running))

    def _fit_running(self, budget: int, prompt_budget: int,
                     preempted: list[int]) -> list[tuple[Request, int, int]]:
        """Preempt the longest-output running requests until the rest fit in the free blocks."""
        while True:
            demand = self._running_demand(budget, prompt_budget)
            if sum(blocks for *_, blocks in demand) <= self.pool.num_free_blocks:
                return [(req, num_tokens, lookahead) for req, num_tokens, lookahead, _ in demand]
            victim = max(self.running, key=lambda r: (len(r.output_ids), r.arrival_time))
            self._preempt(victim, preempted)

    def _preempt(self, req: Request, preempted: list[int]) -> None:
        self.running.remove(req)
        self.awaiting_drafts.discard(req.req_id)  # what its step in flight computed is recomputed
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.blocks_reset = True
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.max_running = max(1, len(self.running))
        preempted.append(req.req_id)

    def _release_blocks(self, req: Request) -> None:
        # Cached blocks stay findable after this: a resumed request usually finds its own prefix again.
        for table in self._tables(req):
            self.pool.free([block for block in table if block != self.no_block])
        req.block_ids, req.group_block_ids, req.window_start = [], [], []
        self._num_registered.pop(req.req_id, None)

    # ---- results --------------------------------------------------------------------------------

    def update(self, result: StepResult) -> list[TokenOutput]:
        """Apply the worker's sampled tokens; finish requests by token id and length."""
        prompt_tokens = self._prompt_tokens.pop(result.step_id, 0)
        self.pace.observe(prompt_tokens, result.seconds)
        self.clock.observe(prompt_tokens, result.seconds)
        outputs: dict[int, TokenOutput] = {}
        for req_id, message in zip(result.failed_req_ids, result.errors):
            out = self.fail_request(req_id, message)
            if out is not None:
                outputs[req_id] = out
        for scored in result.prompt_logprobs:
            req = self.requests.get(scored.req_id)
            if req is not None:
                out = outputs.setdefault(req.req_id, self._output(req))
                out.prompt_logprobs.append(scored)
        for pooled in result.pooled:
            req = self.requests.get(pooled.req_id)
            if req is not None:
                outputs.setdefault(req.req_id, self._output(req)).embedding = pooled.values
        for outcome in result.drafts:
            self.spec.observe(outcome)
        logprobs = result.logprobs or [None] * len(result.token_ids)
        previous = None
        for req_id, token_id, token_logprobs in zip(result.req_ids, result.token_ids, logprobs):
            req = self.requests.get(req_id)
            follows, previous = req_id == previous, req_id
            if req is None:  # finished or aborted while the step ran (or by an earlier token of this step)
                continue
            if not follows:
                req.num_pending -= 1
            elif req_id in self.awaiting_drafts:
                req.num_computed_tokens += 1  # an accepted proposal: its KV was computed in the step
            req.output_ids.append(token_id)
            out = outputs.setdefault(req.req_id, self._output(req))
            out.new_token_ids.append(token_id)
            out.logprobs.append(token_logprobs)
            out.completion_tokens = len(req.output_ids)
            reason = self._check_finish(req, token_id)
            if reason == FinishReason.STOP and req_id in result.cut_short_req_ids:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(req, reason)
                out.finish_reason, out.stop_token_id, out.queue_time = reason, req.stop_token_id, req.queue_time
        for req_id in set(result.req_ids):
            self.awaiting_drafts.discard(req_id)
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._register_full_blocks(req)
        for out in outputs.values():
            if not any(lp is not None for lp in out.logprobs):
                out.logprobs = []
        return list(outputs.values())

    def _register_full_blocks(self, req: Request) -> None:
        """Make the request's newly completed blocks findable by later requests. Called between steps,
        so a request never hits a block another request is computing in the same step."""
        if not self.pool.enable_caching:
            return
        num_known = req.num_prompt_tokens + len(req.output_ids)
        full = min(req.num_computed_tokens, num_known) // self.config.block_size
        done = self._num_registered.get(req.req_id, 0)
        if full > done:
            self._extend_keys(req, full)
            for group, table in enumerate(self._tables(req)):
                for i in range(done, full):
                    if table[i] != self.no_block:
                        self.pool.cache(table[i], _group_key(group, req.block_keys[i]))
            self._num_registered[req.req_id] = full

    def _output(self, req: Request, finish_reason: FinishReason | None = None) -> TokenOutput:
        out = TokenOutput(req.req_id, [], req.num_prompt_tokens, len(req.output_ids), finish_reason,
                          cached_tokens=req.num_cached_tokens or 0)
        if finish_reason is not None:
            out.queue_time = req.queue_time
        return out

    def _check_finish(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.sampling
        num_output = len(req.output_ids)
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                req.stop_token_id = token_id
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.config.eos_token_ids:
                return FinishReason.STOP
        if num_output >= params.max_tokens or req.num_prompt_tokens + num_output >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, cache_blocks: bool = True) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.awaiting_drafts.discard(req.req_id)
        self.spec.forget(req.req_id)
        if req.block_ids:
            if cache_blocks:
                self._register_full_blocks(req)
            self._release_blocks(req)
        self._num_registered.pop(req.req_id, None)
        del self.requests[req.req_id]
        if req.known_to_worker or req.sampling.grammar is not None:  # the worker holds its prepared matcher
            self._finished_for_worker.append(req.req_id)
        idle = not self.running and not self.waiting
        self.max_running = self.config.max_num_seqs if idle else min(self.config.max_num_seqs, self.max_running + 1)

    # ---- introspection --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished_for_worker)

    @property
    def drained(self) -> bool:
        """The worker holds no request: none it started is left (the ones waiting have not begun), and it
        was told of every one that finished."""
        return (not self.running and not self._finished_for_worker
                and not any(req.known_to_worker for req in self.waiting))

    @property
    def speculating(self) -> bool:
        """Plan no step ahead of the one in flight: it speculates, or the next may (a row speculates only
        from a known input token, and how many tokens a speculating step gains is known from its result)."""
        if self.awaiting_drafts:
            return True
        spec = self.spec
        return (spec.enabled and len(self.running) <= spec.disable_batch_size
                and any(spec.may_speculate(req.req_id) for req in self.running))

    @property
    def is_streaming(self) -> bool:
        """Some running request has produced output tokens."""
        return any(req.output_ids for req in self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert len(req.block_ids) >= _blocks_for(req.num_computed_tokens, self.config.block_size)
            tables = self._tables(req)
            assert len(tables) == len(self.windows) and len({len(t) for t in tables}) == 1, "tables disagree"
            blocks = [block for table in tables for block in table if block != self.no_block]
            assert len(set(blocks)) == len(blocks), "a request holds a block twice"
            for block in blocks:
                held[block] = held.get(block, 0) + 1
        self.pool.check_invariants(held)
        for req in self.waiting:
            assert not req.block_ids and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert len(self.running) + len(self.waiting) == len(self.requests)
