"""LLMEngine: the scheduler and the model runner in one process, driven step by step.

For library use, tests and benchmarks; the server runs the same two pieces in separate processes.
With `overlap` each step is planned before the previous step's result is applied, in the order the
server's scheduler process sees them, so the in-process engine exercises the same bookkeeping.
"""

from __future__ import annotations

import itertools
import time

from crane_mp.config import EngineConfig
from crane_mp.protocol import SamplingParams, StepResult, TokenOutput
from crane_mp.scheduler.request import Request
from crane_mp.scheduler.scheduler import Scheduler, scheduler_config
from crane_mp.worker.bootstrap import LoadedWorker, load_worker


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("LLMEngine runs the model in this process, on one rank: tensor parallelism needs "
                             "crane-launch --tensor-parallel-size")
        self.config = config
        self.worker: LoadedWorker = load_worker(config, progress)
        self.scheduler = Scheduler(scheduler_config(
            config, self.worker.kv_plan.num_blocks, self.worker.max_model_len,
            self.worker.model_config.eos_token_ids, on_cpu=self.worker.platform.on_cpu,
            prefill_seconds_per_token=self.worker.prefill_seconds_per_token,
            whole_prompts=self.worker.model_config.encoder, kv_windows=self.worker.runner.kv_groups.windows,
            state_slots=self.worker.kv_plan.state_slots,
            whole_images=getattr(self.worker.runner.model, "bidirectional_images", False),
        ))
        self.overlap = config.overlap_schedule
        self._in_flight: StepResult | None = None  # with overlap: executed, not yet applied
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams) -> int:
        req_id = next(self._ids)
        if sampling.grammar is not None:  # its matcher built now, not inside a step (as the server does)
            self.worker.runner.grammars.prepare(req_id, sampling.grammar)
        self.scheduler.add_request(Request(req_id, list(prompt_ids), sampling, arrival_time=time.time()))
        return req_id

    def abort_request(self, req_id: int) -> None:
        self.scheduler.abort_request(req_id)

    def step(self) -> list[TokenOutput]:
        """Run one scheduler step and forward pass; returns what each advanced request gained."""
        outputs = []
        if self._in_flight is not None and self.scheduler.speculating:  # no plan ahead of a speculating step
            outputs, self._in_flight = self.scheduler.update(self._in_flight), None
        plan = self.scheduler.schedule()
        if not self.overlap:
            return outputs + (self.scheduler.update(self.worker.runner.execute(plan)) if plan is not None else [])
        if self._in_flight is not None:
            outputs = self.scheduler.update(self._in_flight)
        self._in_flight = self.worker.runner.execute(plan) if plan is not None else None
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run `prompts` to completion together; returns each one's output token ids."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_work:
            for out in self.step():
                outputs[out.rid].extend(out.new_token_ids)
        return [outputs[i] for i in ids]
