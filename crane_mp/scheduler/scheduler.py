"""Continuous batching under a KV-block budget: admission, chunked prefill, preemption with lossless resume.

Driven by its owner (the scheduler process, or the in-process engine): `add_request` / `abort_request`
as messages arrive, `schedule()` once per step, `update()` with the worker's `StepResult`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from crane_mp.protocol import NewRequest, PromptLogprobs, ScheduledRequest, StepPlan, StepResult, TokenLogprobs
from crane_mp.scheduler.block_allocator import BlockAllocator
from crane_mp.scheduler.request import FinishReason, Request, RequestStatus


class RequestRejected(ValueError):
    """The request can never run (too long for the context window or the KV cache)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    # Decode rounds per plan when every running request is decoding and nobody waits: fewer
    # scheduler<->worker round trips per token; the tokens produced are the same.
    decode_tokens_per_seq: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs (one decode token each)")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV cache must hold at least one max_model_len sequence")


@dataclass(slots=True)
class RequestOutput:
    """What a request gained in one step: new tokens, and how it ended if it did."""

    req_id: int
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    queue_time: float | None = None  # set on the output that finishes the request


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Effective concurrency cap: lowered on preemption, raised again as requests finish.
        self.max_running = config.max_num_seqs
        # Keep a few blocks spare at admission so running decodes rarely need to preempt.
        self.watermark_blocks = max(1, config.num_blocks // 100)
        self._step_id = 0
        self._finished_for_worker: list[int] = []
        self.num_preemptions = 0

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
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: int) -> Request | None:
        """Finish a request with ABORT wherever it is; unknown or finished ids are ignored."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    # ---- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan one step; None when there is nothing to compute."""
        budget = self.config.max_num_batched_tokens
        new_requests: list[NewRequest] = []
        scheduled: list[ScheduledRequest] = []
        preempted: list[int] = []

        def plan(req: Request, num_tokens: int, rounds: int = 1) -> None:
            # `rounds` decode rounds feed one token each; blocks are reserved for all of them now.
            new_blocks = self._grow_blocks(req, req.num_computed_tokens + num_tokens + rounds - 1)
            if not req.known_to_worker:
                new_requests.append(NewRequest(req.req_id, req.prompt_ids, req.sampling))
                req.known_to_worker = True
                req.queue_time = max(0.0, time.time() - req.arrival_time) if req.arrival_time else 0.0
            scheduled.append(
                ScheduledRequest(req.req_id, req.num_computed_tokens, num_tokens, new_blocks, req.blocks_reset)
            )
            req.blocks_reset = False
            req.num_computed_tokens += num_tokens + rounds - 1

        running_plan = self._fit_running(budget, preempted)
        rounds = 1 if self.waiting else self._decode_rounds(running_plan)
        for req, num_tokens in running_plan:
            plan(req, num_tokens, rounds)
            budget -= num_tokens

        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            num_tokens = min(req.num_tokens - req.num_computed_tokens, budget)
            needed = _blocks_for(req.num_computed_tokens + num_tokens, self.config.block_size) - len(req.block_ids)
            reserve = self.watermark_blocks if self.running else 0
            if not self.allocator.can_allocate(needed + reserve):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan(req, num_tokens)
            budget -= num_tokens

        finished = self._finished_for_worker
        self._finished_for_worker = []
        if not scheduled and not finished and not preempted:
            return None
        self._step_id += 1
        return StepPlan(self._step_id, new_requests, scheduled, preempted, finished, rounds)

    def _grow_blocks(self, req: Request, num_tokens: int) -> list[int]:
        needed = _blocks_for(num_tokens, self.config.block_size) - len(req.block_ids)
        new_blocks = self.allocator.allocate(needed) if needed > 0 else []
        req.block_ids.extend(new_blocks)
        return list(req.block_ids) if req.blocks_reset else new_blocks

    def _decode_rounds(self, running_plan: list[tuple[Request, int]]) -> int:
        """How many decode rounds this plan may run: 1 unless all planned requests are pure decodes."""
        rounds = self.config.decode_tokens_per_seq
        if rounds == 1 or not running_plan:
            return 1
        for req, num_tokens in running_plan:
            if num_tokens != 1 or req.num_computed_tokens != req.num_tokens - 1:
                return 1
            left = min(req.sampling.max_tokens - len(req.output_ids), self.config.max_model_len - req.num_tokens)
            rounds = min(rounds, left)
        size = self.config.block_size
        while rounds > 1:
            extra = sum(
                _blocks_for(req.num_computed_tokens + rounds, size) - len(req.block_ids) for req, _ in running_plan
            )
            if self.allocator.can_allocate(extra):
                break
            rounds -= 1
        return max(rounds, 1)

    def _running_demand(self, budget: int) -> list[tuple[Request, int, int]]:
        """(request, tokens, new blocks) for each running request this step; decodes first, then prefills."""
        demand = []
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            num_tokens = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_tokens == 0:
                continue
            total = _blocks_for(req.num_computed_tokens + num_tokens, self.config.block_size)
            demand.append((req, num_tokens, total - len(req.block_ids)))
            budget -= num_tokens
        return demand

    def _fit_running(self, budget: int, preempted: list[int]) -> list[tuple[Request, int]]:
        """Preempt the longest-output running requests until the rest fit in the free blocks."""
        while True:
            demand = self._running_demand(budget)
            if sum(blocks for _, _, blocks in demand) <= self.allocator.num_free_blocks:
                return [(req, num_tokens) for req, num_tokens, _ in demand]
            victim = max(self.running, key=lambda r: (len(r.output_ids), r.arrival_time))
            self._preempt(victim, preempted)

    def _preempt(self, req: Request, preempted: list[int]) -> None:
        self.running.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.blocks_reset = True
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.max_running = max(1, len(self.running))
        preempted.append(req.req_id)

    # ---- results --------------------------------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply the worker's sampled tokens (all rounds); finish requests by token id and length."""
        outputs: dict[int, RequestOutput] = {}
        for scored in result.prompt_logprobs:
            req = self.requests.get(scored.req_id)
            if req is not None:
                out = outputs.setdefault(req.req_id, RequestOutput(req.req_id, [], req.num_prompt_tokens, 0))
                out.prompt_logprobs.append(scored)
        width = len(result.req_ids)
        logprobs = result.logprobs or [None] * len(result.token_ids)
        for index, token_id in enumerate(result.token_ids):
            req = self.requests.get(result.req_ids[index % width])
            if req is None:  # aborted while the step ran, or finished in an earlier round
                continue
            req.output_ids.append(token_id)
            out = outputs.setdefault(req.req_id, RequestOutput(req.req_id, [], req.num_prompt_tokens, 0))
            out.new_token_ids.append(token_id)
            out.logprobs.append(logprobs[index])
            out.num_output_tokens = len(req.output_ids)
            reason = self._check_finish(req, token_id)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                out.finish_reason, out.stop_token_id, out.queue_time = reason, req.stop_token_id, req.queue_time
        return list(outputs.values())

    def _check_finish(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.sampling
        num_output = len(req.output_ids)
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                req.stop_token_id = token_id
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.config.eos_token_ids:
                return FinishReason.STOP
        if num_output >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        del self.requests[req.req_id]
        if req.known_to_worker:
            self._finished_for_worker.append(req.req_id)
        idle = not self.running and not self.waiting
        self.max_running = self.config.max_num_seqs if idle else min(self.config.max_num_seqs, self.max_running + 1)

    # ---- introspection --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished_for_worker)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        used = sum(len(r.block_ids) for r in self.running)
        assert used == self.config.num_blocks - self.allocator.num_free_blocks, "blocks held outside running"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert len(req.block_ids) >= _blocks_for(req.num_computed_tokens, self.config.block_size)
        for req in self.waiting:
            assert not req.block_ids and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert len(self.running) + len(self.waiting) == len(self.requests)
