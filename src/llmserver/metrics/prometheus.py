"""Prometheus metrics, on a registry of the app's own (no process-wide globals)."""

from __future__ import annotations

import asyncio
import collections
import platform
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Info, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from llmserver import __version__
from llmserver.pool.supervisor import Supervisor

if TYPE_CHECKING:
    from llmserver.cluster.gateways import GatewayLease
    from llmserver.cluster.registry import Registry
    from llmserver.jobs.runner import JobService

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
C = TypeVar("C", bound=Collector)


STATUSES = ("starting", "ready", "busy", "draining", "stopped", "failed")
UNKNOWN_MODEL = "(unknown)"  # the label of requests for a model no configuration names


class _PoolCollector(Collector):
    def __init__(self, supervisor: Supervisor, node: str) -> None:
        self._supervisor = supervisor
        self._node = node  # the label of this process's own instances

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        cold = CounterMetricFamily(
            "llmserver_cold_starts", "Instances started for requests that found none running", labels=["model"]
        )
        cold_seconds = CounterMetricFamily(
            "llmserver_cold_start_seconds", "Seconds those requests waited for the instance to start", labels=["model"]
        )
        evictions = CounterMetricFamily(
            "llmserver_evictions", "Idle instances stopped to make room for another model", labels=["model"]
        )
        crashes = CounterMetricFamily(
            "llmserver_instance_crashes",
            "Instances that died, stopped answering health probes, or stalled (each restarted or given up)",
            labels=["model"],
        )
        stalls = CounterMetricFamily(
            "llmserver_instance_stalls",
            "Instances restarted because their main loop made no progress (requests in flight or not)",
            labels=["model"],
        )
        stalls_by_key = CounterMetricFamily(
            "llmserver_instance_stalls_by_key",
            "Watchdog restarts by the key whose request the instance was working on (key ids, made by admins)",
            labels=["model", "key"],
        )
        depth = GaugeMetricFamily("llmserver_queue_depth", "Requests waiting for a slot", labels=["model"])
        flight = GaugeMetricFamily("llmserver_in_flight", "Requests on instances", labels=["model"])
        instances = GaugeMetricFamily(
            "llmserver_instances", "Instances by node and status", labels=["model", "node", "status"]
        )
        open_ = GaugeMetricFamily(
            "llmserver_instance_unreachable",
            "1 while this process does not route to a node's instance it could not reach (its circuit breaker)",
            labels=["model", "node", "instance"],
        )
        for name, pool in self._supervisor.pools.items():
            depth.add_metric([name], pool.queue_depth)
            cold.add_metric([name], pool.cold_starts)
            cold_seconds.add_metric([name], pool.cold_start_seconds)
            evictions.add_metric([name], pool.evictions)
            stalls.add_metric([name], pool.stalls)
            for key, count in pool.stalls_by_key.items():
                stalls_by_key.add_metric([name, key], count)
            crashes.add_metric([name], pool.crashes)
            flight.add_metric([name], sum(i.in_flight for i in pool.instances))
            nodes: dict[str, collections.Counter[str]] = {self._node: collections.Counter()}
            for instance in pool.instances:
                node = getattr(instance, "node", None) or self._node
                nodes.setdefault(node, collections.Counter())[instance.status.value] += 1
                if node != self._node:
                    broken = instance.status.value == "failed"
                    open_.add_metric([name, node, instance.id], 1.0 if broken else 0.0)
            for node, counts in nodes.items():
                for status in STATUSES:
                    instances.add_metric([name, node, status], counts[status])
        yield from (depth, flight, instances, open_, cold, cold_seconds, evictions, crashes, stalls, stalls_by_key)
        saved = self._supervisor.saved_prompts
        if saved is not None:
            yield CounterMetricFamily(
                "llmserver_prompt_caches_saved", "Conversations' prompt caches saved to disk as instances stopped",
                value=saved.saved,
            )  # fmt: skip
            yield CounterMetricFamily(
                "llmserver_prompt_caches_restored", "Saved prompt caches restored into a slot", value=saved.restored
            )
            yield CounterMetricFamily(
                "llmserver_prompt_cache_restore_failures",
                "Saved prompt caches that could not be restored (the turn read its prompt instead)",
                value=saved.restore_failures,
            )
            yield GaugeMetricFamily(
                "llmserver_prompt_cache_disk_bytes", "Bytes of saved prompt caches on disk", value=saved.disk_bytes
            )


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


class Metrics:
    def __init__(self, supervisor: Supervisor, node: str = "local") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = self._hot(RequestCounts(supervisor.pools))
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
        self.refusals = Counter(
            "llmserver_refusals",
            "Requests answered with an error, by reason: rpm, concurrency, queue_full, queue_timeout, no_instance, "
            "or the error's type (insufficient_quota, invalid_request_error, ...)",
            ["reason"],
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
        self.registry.register(_PoolCollector(supervisor, node))
        self.gateway: GatewayCollector | None = None  # a gateway's; a node has none

    def extracted(self, outcome: str, seconds: float) -> None:
        """One uploaded file's extraction ended (called from the extraction threads)."""
        self.file_extractions.labels(outcome).inc()
        self.extraction_seconds.labels(outcome).observe(seconds)

    def _hot(self, collector: C) -> C:
        self.registry.register(collector)
        return collector

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class GatewayCollector(Collector):
    """What a gateway sees of the shared state: its lease and sweeps, the instance registry and its
    nodes, async jobs and webhooks. `outbox_depth` is read from the store by `refresh()` (once per
    scrape, never per request)."""

    def __init__(self, lease: GatewayLease, jobs: JobService, registry: Registry | None) -> None:
        self._lease, self._jobs, self._registry = lease, jobs, registry
        self.outbox_depth: int | None = None

    async def refresh(self) -> None:
        try:
            async with asyncio.timeout(2):
                self.outbox_depth = await self._jobs.store_outbox_depth()
        except Exception:  # the store is away: the depth is left out of this scrape (the outage shows)
            self.outbox_depth = None

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        now = time.monotonic()
        yield _gauge(
            "llmserver_gateway_lease_age_seconds",
            "Seconds since this gateway last renewed its lease (a lease lapses after gateway_lease_seconds)",
            now - self._lease.renewed_at,
        )
        yield _counter("llmserver_gateways_swept", "Leases of dead gateways this gateway swept", self._lease.swept)
        yield _counter(
            "llmserver_sweep_jobs_failed",
            "Async jobs failed by those sweeps (their gateway died running them)",
            self._lease.jobs_failed_by_sweep,
        )
        yield _gauge("llmserver_async_jobs_running", "Async jobs this gateway is running", self._jobs.running)
        finished = CounterMetricFamily(
            "llmserver_async_jobs_finished", "Async jobs this gateway finished, by outcome", labels=["outcome"]
        )
        for outcome in ("ready", "failed"):
            finished.add_metric([outcome], self._jobs.finished[outcome])
        yield finished
        attempts = CounterMetricFamily(
            "llmserver_webhook_attempts",
            "Webhook deliveries this gateway attempted, by outcome (delivered, retried, failed: given up, "
            "refused: by the receiver or the URL check)",
            labels=["outcome"],
        )
        for outcome in ("delivered", "retried", "failed", "refused"):
            attempts.add_metric([outcome], self._jobs.outbox.attempts[outcome])
        yield attempts
        if self.outbox_depth is not None:
            yield _gauge(
                "llmserver_webhook_outbox_depth", "Webhooks queued in the store (every gateway's)", self.outbox_depth
            )
        registry = self._registry
        if registry is not None:
            yield _gauge(
                "llmserver_registry_age_seconds",
                "Seconds since this gateway last read the instance registry",
                now - registry.read_at,
            )
            yield _gauge(
                "llmserver_registry_instances", "Instances published in the registry", sum(registry.published.values())
            )
            nodes = GaugeMetricFamily(
                "llmserver_node_published_instances", "Instances each node publishes", labels=["node"]
            )
            for node, count in sorted(registry.published.items()):
                nodes.add_metric([node], count)
            yield nodes


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
