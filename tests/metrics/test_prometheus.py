"""The hot path's metrics: plain counts, rendered in Prometheus's text format when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmserver.metrics.prometheus import Counts, Histogram


def scrape(*collectors: Counts | Histogram) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_counts_are_counters_by_label_values() -> None:
    requests = Counts("llmserver_requests", "Generation requests", ("endpoint", "model", "status"))
    requests.inc(("/v1/chat/completions", "m", "ok"))
    requests.inc(("/v1/chat/completions", "m", "ok"))
    requests.inc(("/api/generate", "m", "timeout_error"), 3)
    (family,) = scrape(requests).values()
    assert family == {
        ("llmserver_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "m"), ("status", "ok"))): 2,
        ("llmserver_requests_total", (("endpoint", "/api/generate"), ("model", "m"), ("status", "timeout_error"))): 3,
    }


def test_histogram_buckets_are_cumulative_with_count_and_sum() -> None:
    ttft = Histogram("llmserver_time_to_first_token_seconds", "Time to first token", (0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 2.0):  # a value on a bound falls in that bound's bucket
        ttft.observe("m", seconds)
    ttft.observe("other", 0.01)
    samples = scrape(ttft)["llmserver_time_to_first_token_seconds"]
    bucket = "llmserver_time_to_first_token_seconds_bucket"
    assert samples[(bucket, (("le", "0.1"), ("model", "m")))] == 2
    assert samples[(bucket, (("le", "1.0"), ("model", "m")))] == 3
    assert samples[(bucket, (("le", "+Inf"), ("model", "m")))] == 4
    assert samples[("llmserver_time_to_first_token_seconds_count", (("model", "m"),))] == 4
    assert samples[("llmserver_time_to_first_token_seconds_sum", (("model", "m"),))] == 2.65
    assert samples[("llmserver_time_to_first_token_seconds_count", (("model", "other"),))] == 1
