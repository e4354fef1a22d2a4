"""Shared test factories: one way to build schedulers and requests, and a fake worker that samples by rule."""

from __future__ import annotations

import itertools

from crane_mp.protocol import DraftOutcome, SamplingParams, StepPlan, StepResult
from crane_mp.scheduler.request import Request
from crane_mp.scheduler.scheduler import Scheduler, SchedulerConfig

_ids = itertools.count(1000)


def make_scheduler(**overrides: object) -> Scheduler:
    """A small scheduler: 64 blocks of 4 tokens, 8 sequences, 64-token steps and context."""
    config = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                  eos_token_ids=(2,))
    return Scheduler(SchedulerConfig(**{**config, **overrides}))


def make_requests(
    n: int, prompt_len: int | list[int] = 8, max_tokens: int = 8, **sampling: object
) -> list[Request]:
    lengths = prompt_len if isinstance(prompt_len, list) else [prompt_len] * n
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
    return [
        Request(next(_ids), [10 + (i + j) % 50 for j in range(length)], params, arrival_time=float(i))
        for i, length in enumerate(lengths)
    ]


class FakeWorker:
    """Mirrors what a real worker would know and 'samples' a deterministic function of the sequence so far.

    The next token depends only on the request's full token history, so outputs are identical whatever
    the batching, chunking or preemption, exactly the property a real greedy model has. It also keeps a
    fake KV cache (slot -> token id) through the block tables of every KV group and checks, before every
    sample, that each position a group reads (all of them, or a sliding group's window before the
    step's first query onwards) holds that position's token: a wrong prefix-cache hit, an overwritten
    shared block or a window released too early fails the test.
    """

    def __init__(self, eos_after: dict[int, int] | None = None, block_size: int = 4,
                 fail_at: dict[int, int] | None = None, cut_short: frozenset[int] = frozenset(),
                 windows: tuple[int, ...] = (0,), propose=None) -> None:
        """`propose(tokens, k)`: a speculating row's proposals (worker/speculative/), written to the KV
        cache after its token and kept while they equal what is sampled."""
        self.propose = propose
        self.outcomes: list[DraftOutcome] = []
        self.windows = windows  # the scheduler's kv_windows
        self.cut_short = cut_short  # req ids whose EOS ends a grammar closed early (StepResult.cut_short_req_ids)
        self.fail_at = fail_at or {}  # req id -> the sequence length at which sampling it "raises"
        self.failed: set[int] = set()  # as the real runner: skipped until the scheduler finishes them
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[list[int]]] = {}  # req id -> a block table per KV group
        self.eos_after = eos_after or {}
        self.block_size = block_size
        self.kv: dict[int, int] = {}
        self.plans: list[StepPlan] = []
        self.num_computed = 0  # tokens whose KV was computed, over all steps

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id)
            self.blocks.pop(req_id)
            self.failed.discard(req_id)
        for req_id in plan.preempted_req_ids:
            self.blocks[req_id] = [[] for _ in self.windows]
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.prompt_ids)
            self.blocks[new.req_id] = [[] for _ in self.windows]
        req_ids, token_ids, failed, drafts = [], [], [], []
        for sched in plan.scheduled:
            if sched.req_id in self.failed:
                continue
            tables = self.blocks[sched.req_id]
            new = [sched.new_block_ids, *sched.group_block_ids]
            assert len(new) == len(self.windows)
            self.blocks[sched.req_id] = [list(n) if sched.reset_blocks else t + n for t, n in zip(tables, new)]
            tokens = self.tokens[sched.req_id]
            start, end = sched.num_computed_tokens, sched.num_computed_tokens + sched.num_new_tokens
            proposal = []
            if sched.num_lookahead and self.propose is not None and end == len(tokens):
                proposal = self.propose(tokens, sched.num_lookahead)[: sched.num_lookahead]
            for group in range(len(self.windows)):
                for pos, token in zip(range(start, end + len(proposal)), tokens[start:end] + proposal):
                    self.kv[self._slot(sched.req_id, pos, group)] = token
            self.num_computed += sched.num_new_tokens
            for group, window in enumerate(self.windows):
                for pos in range(max(0, start - window + 1) if window else 0, end):
                    slot = self._slot(sched.req_id, pos, group)
                    assert self.kv.get(slot) == tokens[pos], f"KV of position {pos} in group {group} is wrong"
            if end == len(tokens) and len(tokens) >= self.fail_at.get(sched.req_id, 1 << 30):
                self.failed.add(sched.req_id)
                failed.append(sched.req_id)
            elif end == len(tokens):
                for depth in range(len(proposal) + 1):
                    token = self._next_token(sched.req_id, tokens)
                    tokens.append(token)
                    req_ids.append(sched.req_id)
                    token_ids.append(token)
                    if depth == len(proposal) or token != proposal[depth]:
                        break
                if proposal:
                    drafts.append(DraftOutcome(sched.req_id, len(proposal), depth))
        cut = [req_id for req_id, token in zip(req_ids, token_ids) if token == 2 and req_id in self.cut_short]
        self.outcomes += drafts
        return StepResult(plan.step_id, req_ids, token_ids, failed_req_ids=failed, errors=["boom"] * len(failed),
                          cut_short_req_ids=cut, drafts=drafts)

    def _slot(self, req_id: int, pos: int, group: int = 0) -> int:
        return self.blocks[req_id][group][pos // self.block_size] * self.block_size + pos % self.block_size

    def _next_token(self, req_id: int, tokens: list[int]) -> int:
        if req_id in self.eos_after and len(tokens) >= self.eos_after[req_id]:
            return 2
        return 3 + (sum(tokens) * 31 + len(tokens)) % 97


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 10_000, overlap: bool = False,
    finished: dict | None = None,
) -> dict[int, list[int]]:
    """Drive scheduler + fake worker until idle, checking invariants every step; returns outputs by req id.
    With `overlap` each step is planned before the previous result is applied, as the server does
    (except ahead of a speculating step). `finished` collects each request's finishing output."""
    outputs: dict[int, list[int]] = {}

    def apply(result: StepResult) -> None:
        for out in scheduler.update(result):
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if finished is not None and out.finish_reason is not None:
                finished[out.rid] = out

    in_flight = None
    for _ in range(max_steps):
        if overlap and in_flight is not None and scheduler.speculating:
            apply(in_flight)
            in_flight = None
        plan = scheduler.schedule()
        if not overlap:
            if plan is None:
                break
            results = [worker.execute(plan)]
        else:
            if plan is None and in_flight is None:
                break
            results = [in_flight] if in_flight is not None else []
            in_flight = worker.execute(plan) if plan is not None else None
        for result in results:
            apply(result)
        scheduler.check_invariants()
    assert not scheduler.has_work, "scheduler did not drain"
    return outputs
