"""Prometheus metrics (prometheus_client), under the names vLLM dashboards already query.

Request-level figures (tokens, latencies, finish reasons) are observed here as requests finish;
scheduler figures (running, waiting, KV usage, preemptions) arrive in EngineStats when /metrics is
scraped, over the existing frontend<->scheduler sockets. Each frontend keeps its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from crane_mp.protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                              labels, registry=reg)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (KV blocks reclaimed, later recomputed).",
                                   labels, registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", labels,
                               buckets=_LATENCY_BUCKETS, registry=reg)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt length of finished requests.", labels,
                                    buckets=_TOKEN_BUCKETS, registry=reg)
        self.output_len = Histogram("vllm:request_generation_tokens", "Output length of finished requests.",
                                    labels, buckets=_TOKEN_BUCKETS, registry=reg)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=reg)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=reg)
        self._seen = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}

    def observe_tokens(self, gap: float, count: int) -> None:
        """`count` tokens arrived together, `gap` seconds after the previous ones: the gaps a client
        saw, so a burst shows as one long gap and zeros, not as an even spread."""
        itl = self.itl.labels(self.model_name)
        itl.observe(gap)
        for _ in range(count - 1):
            itl.observe(0.0)

    def request_finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, ttft: float | None, e2e: float,
        queue_time: float | None,
    ) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.request_success.labels(name, reason).inc()
        self.prompt_len.labels(name).observe(prompt_tokens)
        self.output_len.labels(name).observe(completion_tokens)
        self.e2e.labels(name).observe(e2e)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
        if queue_time is not None:
            self.queue.labels(name).observe(queue_time)

    def render(self, stats: EngineStats | None) -> bytes:
        if stats is not None:
            name = self.model_name
            self.running.labels(name).set(stats.num_running)
            self.waiting.labels(name).set(stats.num_waiting)
            used = stats.num_total_blocks - stats.num_free_blocks
            self.kv_usage.labels(name).set(used / stats.num_total_blocks if stats.num_total_blocks else 0.0)
            self._advance("preemptions", stats.num_preemptions)
            self._advance("prefix_queries", stats.prefix_cache_queries)
            self._advance("prefix_hits", stats.prefix_cache_hits)
        return generate_latest(self.registry)

    def _advance(self, name: str, total: int) -> None:
        """Move counter `name` up to the scheduler's running total."""
        if total > self._seen[name]:
            getattr(self, name).labels(self.model_name).inc(total - self._seen[name])
            self._seen[name] = total
