"""Prometheus metrics (prometheus_client), under the names vLLM dashboards already query.

Request-level figures (tokens, latencies, finish reasons, rejections, refused connections) are
observed by the frontend that served the request. With several frontends (crane-launch sets
PROMETHEUS_MULTIPROC_DIR) they go to prometheus_client's shared files and every scrape sums all
frontends. Scheduler figures (running, waiting, KV usage, preemptions, prefix cache) are whole-server
already: they arrive in EngineStats when /metrics is scraped and are rendered as they are (the last
answer, if the scheduler is silent).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from crane_mp.protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_LABELS = ("model_name", "replica")
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    def __init__(self, model_name: str, replica: str) -> None:
        # Every series is labelled with the model and the replica (--replica-name): one dashboard over
        # several servers behind a router tells them apart whatever the scrape's own labels.
        self.names = (model_name, replica)
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # Shared mode: the values live in files; the metric objects must not be in a rendered registry.
        self.registry = None if self.shared_dir else CollectorRegistry()
        labels = list(_LABELS)
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.rejected = Counter("crane:requests_rejected", "Requests refused with 429 (--max-queue).", labels,
                                registry=reg)
        self.connections_refused = Counter("crane:connections_refused", "Connections refused with 503 past "
                                           "--max-connections.", labels, registry=reg)
        self.timed_out = Counter("crane:requests_timed_out", "Requests ended by --request-timeout.", labels,
                                 registry=reg)
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
        self.images = Histogram("crane:request_images", "Images per request that held any.", labels,
                                buckets=(1, 2, 3, 4, 6, 8, 16), registry=reg)
        self.audio_seconds = Histogram("crane:request_audio_seconds", "Seconds of audio per transcription "
                                       "or translation request.", labels,
                                       buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800), registry=reg)
        self.last_stats: EngineStats | None = None

    def media_received(self, images: int = 0, audio_seconds: float = 0.0) -> None:
        if images:
            self.images.labels(*self.names).observe(images)
        if audio_seconds:
            self.audio_seconds.labels(*self.names).observe(audio_seconds)

    def request_rejected(self) -> None:
        self.rejected.labels(*self.names).inc()

    def connection_refused(self) -> None:
        self.connections_refused.labels(*self.names).inc()

    def observe_tokens(self, gap: float, count: int) -> None:
        """`count` tokens arrived together, `gap` seconds after the previous ones: the gaps a client
        saw, so a burst shows as one long gap and zeros, not as an even spread."""
        itl = self.itl.labels(*self.names)
        itl.observe(gap)
        for _ in range(count - 1):
            itl.observe(0.0)

    def request_finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, ttft: float | None, e2e: float,
        queue_time: float | None,
    ) -> None:
        names = self.names
        if reason == "rejected":  # never ran; the 429 is counted once per HTTP request (access_log.py)
            return
        if reason == "timeout":
            self.timed_out.labels(*names).inc()
        self.prompt_tokens.labels(*names).inc(prompt_tokens)
        self.generation_tokens.labels(*names).inc(completion_tokens)
        self.request_success.labels(*names, reason).inc()
        self.prompt_len.labels(*names).observe(prompt_tokens)
        self.output_len.labels(*names).observe(completion_tokens)
        self.e2e.labels(*names).observe(e2e)
        if ttft is not None:
            self.ttft.labels(*names).observe(ttft)
        if queue_time is not None:
            self.queue.labels(*names).observe(queue_time)

    def render(self, stats: EngineStats | None) -> bytes:
        if stats is not None:
            self.last_stats = stats
        if self.shared_dir:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self.shared_dir)
        else:
            registry = self.registry
        text = generate_latest(registry)
        if self.last_stats is not None:
            engine = CollectorRegistry()
            engine.register(_EngineCollector(self.names, self.last_stats))
            text += generate_latest(engine)
        return text


class _EngineCollector:
    """The scheduler's figures, as gauges and counters, from one EngineStats."""

    def __init__(self, names: tuple[str, str], stats: EngineStats) -> None:
        self.names = list(names)
        self.stats = stats

    def collect(self):
        s, names = self.stats, self.names
        used = s.num_total_blocks - s.num_free_blocks
        for metric, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             used / s.num_total_blocks if s.num_total_blocks else 0.0),
        ):
            family = GaugeMetricFamily(metric, doc, labels=_LABELS)
            family.add_metric(names, value)
            yield family
        for metric, doc, value in (
            ("vllm:num_preemptions", "Preemptions (KV blocks reclaimed, later recomputed).", s.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ):
            family = CounterMetricFamily(metric, doc, labels=_LABELS)
            family.add_metric(names, value)
            yield family
        if s.spec_accepted_per_position:  # speculative decoding is on (vLLM's names)
            for metric, doc, value in (
                ("vllm:spec_decode_num_drafts", "Steps of a request that proposed tokens.", s.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Tokens proposed.", s.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens the model accepted.",
                 s.spec_accepted_tokens),
            ):
                family = CounterMetricFamily(metric, doc, labels=_LABELS)
                family.add_metric(names, value)
                yield family
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
                                         "by their position in the proposal.", labels=[*_LABELS, "position"])
            for position, count in enumerate(s.spec_accepted_per_position):
                family.add_metric([*names, str(position)], count)
            yield family
        if s.expert_tokens:  # a mixture of experts' load balance
            family = CounterMetricFamily("crane:expert_tokens", "Tokens routed to each expert of the mixture-of-"
                                         "experts layers, summed over the layers.", labels=[*_LABELS, "expert"])
            for expert, count in enumerate(s.expert_tokens):
                family.add_metric([*names, str(expert)], count)
            yield family
