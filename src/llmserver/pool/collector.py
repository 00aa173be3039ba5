"""The pool's metrics, read from the supervisor when scraped: queues, instances by node and status,
cold starts, evictions, crashes, stalls, and the saved prompt caches."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmserver.pool.supervisor import Supervisor

STATUSES = ("starting", "ready", "busy", "draining", "stopped", "failed")


class PoolCollector(Collector):
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
        yields = CounterMetricFamily(
            "llmserver_slot_yields",
            "Streamed requests that gave their slot to another key below its share of the model's slots, and went "
            "on from where they stopped once they had one again (limits.fair_slice)",
            labels=["model"],
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
        blocked = GaugeMetricFamily(
            "llmserver_model_blocked",
            "1 while no instance of the model can be started here (its file, a failed start, no node to place it "
            "on, the memory budget): the reason is in /api/models and /ready",
            labels=["model"],
        )
        for name, pool in self._supervisor.pools.items():
            blocked.add_metric([name], 1.0 if (pool.unstartable or pool.blocked) else 0.0)
            depth.add_metric([name], pool.queue_depth)
            cold.add_metric([name], pool.cold_starts)
            cold_seconds.add_metric([name], pool.cold_start_seconds)
            evictions.add_metric([name], pool.evictions)
            yields.add_metric([name], pool.yields)
            stalls.add_metric([name], pool.stalls)
            for key, count in pool.stalls_by_key.items():
                stalls_by_key.add_metric([name, key], count)
            crashes.add_metric([name], pool.crashes)
            flight.add_metric([name], sum(i.in_flight for i in pool.instances))
            nodes: dict[str, collections.Counter[str]] = {self._node: collections.Counter()}
            for instance in pool.instances:
                node = instance.placed_on or self._node
                nodes.setdefault(node, collections.Counter())[instance.status.value] += 1
                if node != self._node:
                    broken = instance.status.value == "failed"
                    open_.add_metric([name, node, instance.id], 1.0 if broken else 0.0)
            for node, counts in nodes.items():
                for status in STATUSES:
                    instances.add_metric([name, node, status], counts[status])
        yield from (depth, flight, instances, open_, blocked, cold, cold_seconds, evictions, crashes, stalls)
        yield from (stalls_by_key, yields)
        saved = self._supervisor.saved_prompts
        if saved is not None:
            yield CounterMetricFamily(
                "llmserver_prompt_caches_saved", "Conversations' prompt caches saved to disk as instances stopped",
                value=saved.saved,
            )  # fmt: skip
            yield CounterMetricFamily(
                "llmserver_prompt_caches_displaced",
                "Conversations' prompt caches saved to disk as another conversation took their slot",
                value=saved.displaced,
            )
            yield CounterMetricFamily(
                "llmserver_prompt_caches_restored", "Saved prompt caches restored into a slot", value=saved.restored
            )
            yield CounterMetricFamily(
                "llmserver_prompt_cache_restore_failures",
                "Saved prompt caches that could not be restored (the turn read its prompt instead)",
                value=saved.restore_failures,
            )
            yield CounterMetricFamily(
                "llmserver_prompt_caches_fetched",
                "Saved prompt caches carried from the node that saved them to the node whose instance took the turn",
                value=saved.fetched,
            )
            yield CounterMetricFamily(
                "llmserver_prompt_cache_fetch_failures",
                "Saved prompt caches that could not be carried from another node (the turn read its prompt instead)",
                value=saved.fetch_failures,
            )
            yield GaugeMetricFamily(
                "llmserver_prompt_cache_disk_bytes", "Bytes of saved prompt caches on disk", value=saved.disk_bytes
            )
