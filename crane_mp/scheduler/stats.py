"""Running totals the scheduler reports to frontends (for /server_info, /v1/stats and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from crane_mp.protocol import EngineStats, TokenOutput
from crane_mp.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class EngineCounters:
    total_requests: int = 0
    completed_requests: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_tokens_per_sec: float = 0.0  # exponential moving average over busy steps
    expert_tokens: list[int] = field(default_factory=list)  # tokens routed to each expert, summed over layers

    def on_request(self, num_prompt_tokens: int) -> None:
        self.total_requests += 1
        self.prompt_tokens_total += num_prompt_tokens

    def on_step(self, outputs: list[TokenOutput], elapsed: float) -> None:
        # An embedding request's one token is a placeholder, not generated text.
        generated = sum(len(o.new_token_ids) for o in outputs if o.embedding is None)
        self.generation_tokens_total += generated
        self.completed_requests += sum(o.finish_reason is not None for o in outputs)
        if generated and elapsed > 0:
            rate = generated / elapsed
            self.decode_tokens_per_sec = rate if not self.decode_tokens_per_sec else (
                0.9 * self.decode_tokens_per_sec + 0.1 * rate
            )

    def on_routing(self, step_counts: list[int]) -> None:
        """Add a step's tokens per expert (StepResult.expert_tokens)."""
        if len(self.expert_tokens) < len(step_counts):
            self.expert_tokens.extend([0] * (len(step_counts) - len(self.expert_tokens)))
        for expert, count in enumerate(step_counts):
            self.expert_tokens[expert] += count

    def snapshot(self, scheduler: Scheduler, token: int, step_age: float = 0.0,
                 awaiting_grammar: int = 0) -> EngineStats:
        """`awaiting_grammar`: requests whose grammar the worker is still building count as waiting (as vLLM's
        WAITING_FOR_FSM requests do), so a queued request is never missing from the figures."""
        spec = scheduler.spec.counters
        return EngineStats(
            token=token,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + awaiting_grammar,
            num_free_blocks=scheduler.num_free_blocks,
            num_total_blocks=scheduler.config.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            total_requests=self.total_requests,
            completed_requests=self.completed_requests,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            avg_decode_tokens_per_sec=round(self.decode_tokens_per_sec, 2),
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_cached_blocks=scheduler.pool.num_cached_blocks,
            step_age=round(step_age, 3),
            expert_tokens=list(self.expert_tokens),
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )
