"""The hot path's metrics: plain counts, rendered in Prometheus's text format when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmserver.metrics.prometheus import Histogram, RequestCounts


def scrape(*collectors: RequestCounts | Histogram) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_requests_are_counted_by_endpoint_model_and_outcome_and_their_tokens_by_model() -> None:
    requests = RequestCounts({"m": None, "other": None})
    requests.add("/v1/chat/completions", "m", "ok", prompt=10, cached=8, completion=5)
    requests.add("/v1/chat/completions", "m", "ok", prompt=20, completion=7)
    requests.add("/api/generate", "m", "client_closed", prompt=4, completion=1)
    requests.add("/api/generate", "m", "timeout_error")
    requests.add("/v1/completions", "other", "ok", prompt=3, cached=3, completion=2)
    families = scrape(requests)
    assert families["llmserver_requests"] == {
        ("llmserver_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "m"), ("status", "ok"))): 2,
        ("llmserver_requests_total", (("endpoint", "/api/generate"), ("model", "m"), ("status", "client_closed"))): 1,
        ("llmserver_requests_total", (("endpoint", "/api/generate"), ("model", "m"), ("status", "timeout_error"))): 1,
        ("llmserver_requests_total", (("endpoint", "/v1/completions"), ("model", "other"), ("status", "ok"))): 1,
    }
    for family, m, other in (
        ("llmserver_prompt_tokens", 34, 3),
        ("llmserver_cached_prompt_tokens", 8, 3),
        ("llmserver_completion_tokens", 13, 2),
    ):
        assert families[family] == {
            (f"{family}_total", (("model", "m"),)): m,
            (f"{family}_total", (("model", "other"),)): other,
        }


def test_a_model_no_configuration_names_is_counted_under_one_label() -> None:
    """A client's model names never become labels: 1,000 made-up names add one series, not 1,000."""
    requests = RequestCounts({"m": None})
    for n in range(1000):
        requests.add("/v1/chat/completions", f"random-{n}", "not_found_error")
    requests.add("/v1/chat/completions", "m", "ok", prompt=2, completion=1)
    families = scrape(requests)
    assert families["llmserver_requests"] == {
        ("llmserver_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "(unknown)"),
                                      ("status", "not_found_error"))): 1000,
        ("llmserver_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "m"), ("status", "ok"))): 1,
    }  # fmt: skip


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
