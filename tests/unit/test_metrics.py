"""Prometheus figures the frontend keeps: arrival gaps as clients see them, scheduler totals as counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from crane_mp.frontend.web.metrics import Metrics
from crane_mp.protocol import EngineStats

LABELS = "('model_name', 'm'), ('replica', 'host-a:8080')"


def samples(metrics: Metrics, stats: EngineStats | None = None) -> dict[str, float]:
    text = metrics.render(stats).decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def stats(preemptions: int, queries: int, hits: int) -> EngineStats:
    return EngineStats(1, 0, 0, 10, 10, preemptions, 0, 0, 0, 0, 0.0, queries, hits, 0)


def test_a_burst_of_tokens_counts_as_one_gap_and_zeros():
    metrics = Metrics("m", "host-a:8080")
    metrics.observe_tokens(0.5, 3)  # three tokens arrived together, half a second after the last
    values = samples(metrics)
    assert values[f"vllm:inter_token_latency_seconds_count[{LABELS}]"] == 3
    assert values[f"vllm:inter_token_latency_seconds_sum[{LABELS}]"] == 0.5
    assert values[f"vllm:inter_token_latency_seconds_bucket[('le', '0.005'), {LABELS}]"] == 2


def test_scheduler_totals_become_monotonic_counters():
    metrics = Metrics("m", "host-a:8080")
    samples(metrics, stats(2, 100, 64))
    values = samples(metrics, stats(3, 150, 96))
    assert values[f"vllm:prefix_cache_queries_total[{LABELS}]"] == 150
    assert values[f"vllm:prefix_cache_hits_total[{LABELS}]"] == 96
    assert values[f"vllm:num_preemptions_total[{LABELS}]"] == 3
    values = samples(metrics, None)  # a scrape the scheduler did not answer changes nothing
    assert values[f"vllm:prefix_cache_hits_total[{LABELS}]"] == 96
