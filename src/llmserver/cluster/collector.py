"""A gateway's metrics of the shared state: its lease and sweeps, the instance registry and its
nodes, async jobs and webhooks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmserver.cluster.gateways import GatewayLease
from llmserver.cluster.registry import Registry
from llmserver.jobs.runner import JobService
from llmserver.metrics.prometheus import Refreshed, counter, gauge


class GatewayCollector(Refreshed):
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
        yield gauge(
            "llmserver_gateway_lease_age_seconds",
            "Seconds since this gateway last renewed its lease (a lease lapses after gateway_lease_seconds)",
            now - self._lease.renewed_at,
        )
        yield counter("llmserver_gateways_swept", "Leases of dead gateways this gateway swept", self._lease.swept)
        yield counter(
            "llmserver_sweep_jobs_failed",
            "Async jobs failed by those sweeps (their gateway died running them)",
            self._lease.jobs_failed_by_sweep,
        )
        yield gauge("llmserver_async_jobs_running", "Async jobs this gateway is running", self._jobs.running)
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
            yield gauge(
                "llmserver_webhook_outbox_depth", "Webhooks queued in the store (every gateway's)", self.outbox_depth
            )
        registry = self._registry
        if registry is not None:
            yield gauge(
                "llmserver_registry_age_seconds",
                "Seconds since this gateway last read the instance registry",
                now - registry.read_at,
            )
            yield gauge(
                "llmserver_registry_instances", "Instances published in the registry", sum(registry.published.values())
            )
            nodes = GaugeMetricFamily(
                "llmserver_node_published_instances", "Instances each node publishes", labels=["node"]
            )
            for node, count in sorted(registry.published.items()):
                nodes.add_metric([node], count)
            yield nodes
