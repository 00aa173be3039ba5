"""Readiness that tells the truth: each component a process depends on, probed, for `/ready` and `/metrics`.

A gateway is ready when its database answers, Redis answers (when configured), its instance registry
has been read within `REGISTRY_FRESH` seconds (role `gateway`), and it can serve models: those of
`server.ready_models` if set, else any one (`models_probe`) — one model that cannot run never takes the
gateway out of its load balancer (its reason is in the detail); a node when Redis answers, it has
published its instances recently, and it can serve. `/health` checks none of it: the process answers.

Probes are cheap and never run per request: the states are probed at most once per `CACHE_SECONDS`,
one probe round at a time (callers meanwhile share the round under way), each probe bounded by
`PROBE_TIMEOUT`; what reads only this process's state (its models, the registry's age) is checked on
every call. The same states feed the `llmserver_component_*` metrics, so a scrape during an
outage shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmserver.errors import APIError
from llmserver.pool.pool import ModelPool

log = logging.getLogger(__name__)

CACHE_SECONDS = 1.0
PROBE_TIMEOUT = 1.5
REGISTRY_FRESH = 3.0  # seconds: the registry is read every half second; records expire after 3

# A probe: raises when its component cannot serve; returns a short detail (or None) when it can.
Probe = Callable[[], Awaitable[str | None]]


@dataclass
class Component:
    up: bool = True
    detail: str | None = None
    seconds: float | None = None  # the last probe's duration
    since: float = field(default_factory=time.time)  # when it last changed state
    failures: int = 0  # probes that failed
    outages: int = 0  # times it went down

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"status": "up" if self.up else "down", "since": round(self.since, 3)}
        if self.detail:
            described["detail"] = self.detail
        if self.seconds is not None:
            described["latency_ms"] = round(self.seconds * 1000, 1)
        return described


class Readiness(Collector):
    """`probes` ask over the network (cached, one round at a time); `live` read this process's own state
    (run on every check: they cost nothing, and a crash shows at once)."""

    def __init__(self, probes: Mapping[str, Probe], live: Mapping[str, Probe] | None = None) -> None:
        self._probes = dict(probes)
        self._live = dict(live or {})
        self.components = {name: Component() for name in (*self._probes, *self._live)}
        self._round: asyncio.Task[None] | None = None
        self._checked_at = float("-inf")

    async def check(self) -> dict[str, Component]:
        """The components' states, at most `CACHE_SECONDS` old."""
        if self._round is None or (self._round.done() and time.monotonic() - self._checked_at >= CACHE_SECONDS):
            self._round = asyncio.get_running_loop().create_task(self._probe_all(), name="readiness")
        for name, probe in self._live.items():
            await self._probe(name, probe)
        await asyncio.shield(self._round)
        return self.components

    @property
    def ready(self) -> bool:
        return all(component.up for component in self.components.values())

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(name, probe) for name, probe in self._probes.items()))
        self._checked_at = time.monotonic()

    async def _probe(self, name: str, probe: Probe) -> None:
        component = self.components[name]
        started = time.perf_counter()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                detail = await probe()
        except TimeoutError:
            self._down(name, component, f"no answer within {PROBE_TIMEOUT:g} s")
        except APIError as exc:
            self._down(name, component, exc.message)
        except Exception as exc:  # a probe's failure is the component's state, whatever it raised
            self._down(name, component, str(exc) or type(exc).__name__)
        else:
            if not component.up:
                component.up, component.since = True, time.time()
                log.info("readiness: %s is up again", name)
            component.detail = detail
        component.seconds = time.perf_counter() - started

    @staticmethod
    def _down(name: str, component: Component, detail: str) -> None:
        component.failures += 1
        component.detail = detail
        if component.up:
            component.up, component.since = False, time.time()
            component.outages += 1
            log.warning("readiness: %s is down (%s): not ready", name, detail)

    def body(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not_ready",
            "components": {name: component.describe() for name, component in self.components.items()},
        }

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "llmserver_component_up", "1 when the component answered its last readiness probe", labels=["component"]
        )
        seconds = GaugeMetricFamily(
            "llmserver_component_probe_seconds",
            "Duration of the component's last readiness probe",
            labels=["component"],
        )
        failures = CounterMetricFamily(
            "llmserver_component_probe_failures", "Readiness probes the component failed", labels=["component"]
        )
        outages = CounterMetricFamily(
            "llmserver_component_outages", "Times the component went from up to down", labels=["component"]
        )
        for name, component in self.components.items():
            up.add_metric([name], 1.0 if component.up else 0.0)
            if component.seconds is not None:
                seconds.add_metric([name], component.seconds)
            failures.add_metric([name], component.failures)
            outages.add_metric([name], component.outages)
        yield from (up, seconds, failures, outages)


def models_probe(pools: Mapping[str, ModelPool], required: Collection[str] = ()) -> Probe:
    """This process can serve models. With `required` (server.ready_models): each of those has an
    instance that serves. Without: at least one model serves, or can be started on demand, or there is
    no model at all. A model that cannot run is that model's problem (its detail here, /api/models, the
    metrics), never a reason to take the whole gateway out of its load balancer."""

    async def probe() -> str | None:
        if required:
            missing = [name for name in required if name not in pools or not pools[name].ready]
            if missing:
                raise RuntimeError("no instance serves " + ", ".join(missing) + _why(pools, missing))
        down = [name for name, pool in pools.items() if not pool.ready and _kept_or_stuck(pool)]
        if required or not pools:
            return ("not serving: " + ", ".join(down) + _why(pools, down)) if down else None
        if all(not pool.ready and _kept_or_stuck(pool) for pool in pools.values()):
            raise RuntimeError("no model serves: " + ", ".join(down) + _why(pools, down))
        return ("not serving: " + ", ".join(down) + _why(pools, down)) if down else None

    return probe


def _kept_or_stuck(pool: ModelPool) -> bool:
    """Whether a model without a serving instance counts as down: one kept at min_instances > 0, or one
    that cannot be started at all (a model started on demand is otherwise merely idle)."""
    return pool.config.min_instances > 0 or pool.unstartable is not None


def _why(pools: Mapping[str, ModelPool], names: list[str]) -> str:
    reasons = [
        f"{name}: {reason}"
        for name in names if name in pools
        for reason in [pools[name].unstartable or pools[name].blocked]
        + [f"instance {i.id} {i.failure}" for i in pools[name].instances if i.failure]
        if reason
    ]  # fmt: skip
    return f" ({'; '.join(reasons)})" if reasons else ""


def fresh_probe(what: str, last: Callable[[], float], bound: float = REGISTRY_FRESH) -> Probe:
    """`last()` (a monotonic time) is within `bound` seconds."""

    async def probe() -> str | None:
        age = time.monotonic() - last()
        if age == float("inf"):
            raise RuntimeError(f"{what}: not yet")
        if age > bound:
            raise RuntimeError(f"{what} {age:.1f} s ago (more than {bound:g} s)")
        return None

    return probe


def redis_probe(client: Any) -> Probe:
    async def probe() -> str | None:
        await client.ping()
        return None

    return probe
