"""Prometheus metrics, on a registry of the app's own (no process-wide globals)."""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from itertools import accumulate
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Info, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from llmserver import __version__

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
C = TypeVar("C", bound=Collector)


UNKNOWN_MODEL = "(unknown)"  # the label of requests for a model no configuration names


class Histogram(Collector):
    """A histogram by model, observed on the hot path (a request's time to first token, each streamed
    token's gap): a list of counts per model, where prometheus_client's Histogram takes a lock for
    each of the buckets a value falls in (the event loop is the only writer). Rendered when scraped."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name, self._documentation, self._buckets = name, documentation, buckets
        self._counts: dict[str, list[float]] = {}  # per bucket (+Inf last), then the sum

    def observe(self, model: str, seconds: float) -> None:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = [0] * (len(self._buckets) + 2)
        counts[bisect_left(self._buckets, seconds)] += 1
        counts[-1] += seconds

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=["model"])
        bounds = [*(repr(bound) for bound in self._buckets), "+Inf"]
        for model, counts in self._counts.items():
            family.add_metric([model], list(zip(bounds, accumulate(counts[:-1]), strict=True)), counts[-1])
        yield family


TOKEN_FAMILIES = (
    ("llmserver_prompt_tokens", "Prompt tokens"),
    (
        "llmserver_cached_prompt_tokens",
        "Prompt tokens the instances took from their prompt cache (of llmserver_prompt_tokens)",
    ),
    ("llmserver_completion_tokens", "Completion tokens"),
)


class RequestCounts(Collector):
    """Generation requests by endpoint, model and outcome, and their tokens by model, counted on the
    hot path: one list of plain numbers per (endpoint, model, outcome), added to once per request
    (prometheus_client's Counter takes a lock for each increment, and four counters were four
    lookups); the families are summed from them when scraped."""

    def __init__(self, models: Mapping[str, object]) -> None:
        self._models = models  # the configured ones: a label names one of them, or UNKNOWN_MODEL
        self._counts: dict[tuple[str, str, str], list[int]] = {}  # requests, prompt, cached, completion

    def add(
        self, endpoint: str, model: str, outcome: str, prompt: int = 0, cached: int = 0, completion: int = 0
    ) -> None:
        counts = self._counts.get((endpoint, model, outcome))
        if counts is None:
            if model not in self._models and model != UNKNOWN_MODEL:  # a client's name: never a label of its own
                self.add(endpoint, UNKNOWN_MODEL, outcome, prompt, cached, completion)
                return
            counts = self._counts[(endpoint, model, outcome)] = [0, 0, 0, 0]
        counts[0] += 1
        counts[1] += prompt
        counts[2] += cached
        counts[3] += completion

    def collect(self) -> Iterable[CounterMetricFamily]:
        requests = CounterMetricFamily(
            "llmserver_requests", "Generation requests", labels=["endpoint", "model", "status"]
        )
        tokens = [CounterMetricFamily(name, documentation, labels=["model"]) for name, documentation in TOKEN_FAMILIES]
        by_model: dict[str, list[int]] = {}
        for (endpoint, model, outcome), counts in self._counts.items():
            requests.add_metric([endpoint, model, outcome], counts[0])
            totals = by_model.setdefault(model, [0, 0, 0])
            for index in range(3):
                totals[index] += counts[index + 1]
        for model, totals in by_model.items():
            for family, total in zip(tokens, totals, strict=True):
                family.add_metric([model], total)
        yield requests
        yield from tokens


class Refreshed(Collector):
    """A collector that reads something slow (the store) once per scrape, before collecting."""

    async def refresh(self) -> None: ...


class Metrics:
    """The process's metrics: the hot-path counters and histograms it observes, and the collectors of
    the layers above registered by whoever builds them (pool/collector.py, cluster/collector.py)."""

    def __init__(self, models: Mapping[str, object]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = self._hot(RequestCounts(models))
        self.ttft = self._hot(
            Histogram("llmserver_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        )
        self.inter_token = self._hot(
            Histogram("llmserver_inter_token_seconds", "Gaps between streamed tokens", GAP_BUCKETS)
        )
        self.queue_wait = self._hot(
            Histogram("llmserver_queue_wait_seconds", "Time a request waited for a slot", LATENCY_BUCKETS)
        )
        self.quota_rejections = Counter(
            "llmserver_quota_rejections", "Requests refused by a key's limits", ["type"], registry=self.registry
        )
        self.budget_alerts = Counter(
            "llmserver_budget_alerts",
            "Budget thresholds (billing.budget_alerts) crossed, once each per period, by a key's or a team's spend",
            ["owner", "threshold"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "llmserver_refusals",
            "Requests answered with an error, by reason: rpm, concurrency, queue_full, queue_timeout, no_instance, "
            "or the error's type (insufficient_quota, invalid_request_error, ...)",
            ["reason"],
            registry=self.registry,
        )
        self.admin_actions = Counter(
            "llmserver_admin_actions",
            "Admin actions through the API that went through, by action (keys.create, models.update, "
            "nodes.drain, ...); each is a row of the audit log",
            ["action"],
            registry=self.registry,
        )
        self.file_extractions = Counter(
            "llmserver_file_extractions",
            "Uploaded files extracted in a child process, by outcome (ok, unextractable, memory, timeout, crashed)",
            ["outcome"],
            registry=self.registry,
        )
        self.extraction_seconds = PromHistogram(
            "llmserver_file_extraction_seconds",
            "Time one uploaded file's extraction took (in its child process), by outcome",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.image_seconds = PromHistogram(
            "llmserver_image_preparation_seconds",
            "Time one image took to decode or fetch, check and resize, by source (data, url)",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        Info("llmserver_build", "The build of this process", registry=self.registry).info(
            {"version": __version__, "python": platform.python_version()}
        )
        self.gateway: Refreshed | None = None  # a gateway's view of the shared state; a node has none

    def extracted(self, outcome: str, seconds: float) -> None:
        """One uploaded file's extraction ended (called from the extraction threads)."""
        self.file_extractions.labels(outcome).inc()
        self.extraction_seconds.labels(outcome).observe(seconds)

    def _hot(self, collector: C) -> C:
        self.registry.register(collector)
        return collector

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
