"""Helpers of the pool, admission and engine tests: instances with no process behind them, pools of
them, and an admission over a real SQLite store with the in-process limiters (nothing is sent anywhere)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from llmserver.auth.keys import Principal
from llmserver.auth.limiters import MemoryConcurrencyLimiter, MemoryRateLimiter
from llmserver.auth.quota import QuotaService
from llmserver.llama.client import LlamaServerClient
from llmserver.metrics.prometheus import Metrics
from llmserver.metrics.recorder import UsageRecorder
from llmserver.metrics.speed import RollingSpeed
from llmserver.pool.admission import Admission
from llmserver.pool.instance import Instance, Status
from llmserver.pool.pool import ModelPool
from llmserver.pool.router import Router
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import ModelConfig, Settings
from llmserver.store.sqlite import SQLiteStore


async def ready_instance(model: ModelConfig, port: int) -> Instance:
    instance = Instance(model=model, host="127.0.0.1", port=port, log_path=Path("/dev/null"))
    instance.client = LlamaServerClient(instance.base_url)  # never called here
    instance.status = Status.READY
    return instance


async def close(*instances: Instance) -> None:
    for instance in instances:
        assert instance.client is not None
        await instance.client.close()


def make_pool(
    max_queue: int = 2, queue_timeout: float = 5.0, parallel: int = 1, instance_queue: int = 0
) -> tuple[ModelPool, list[ModelPool]]:
    """A pool whose instances take no requests beyond their slots, unless `instance_queue` says so."""
    pressured: list[ModelPool] = []
    config = ModelConfig(name="m", parallel=parallel, max_queue=max_queue, instance_queue=instance_queue)
    return ModelPool(config, queue_timeout=queue_timeout, on_pressure=pressured.append), pressured


@dataclass
class World:
    admission: Admission
    store: SQLiteStore
    quota: QuotaService
    rate: MemoryRateLimiter
    places: MemoryConcurrencyLimiter
    recorder: UsageRecorder
    supervisor: Supervisor
    metrics: Metrics

    async def remaining(self, who: Principal) -> int:
        await self.recorder.flush()
        return int((await self.quota.headers(who))["x-ratelimit-remaining-tokens"])

    def rejections(self, kind: str) -> float:
        return self.metrics.quota_rejections.labels(kind)._value.get()


@asynccontextmanager
async def world(tmp_path: Path, max_queue: int = 1) -> AsyncIterator[World]:
    settings = Settings(
        models=[ModelConfig(name="m", parallel=1, max_queue=max_queue, instance_queue=0)],
        limits={"max_concurrency_per_key": 2},
    )
    supervisor = Supervisor(settings)
    pool = supervisor.pools["m"]
    pool.queue_timeout = 30
    pool.instances.append(await ready_instance(pool.config, 1))
    store = SQLiteStore(tmp_path / "a.db")
    quota = QuotaService(store, "gw1")
    metrics = Metrics(supervisor.pools)
    recorder = UsageRecorder(store, quota, RollingSpeed(store), metrics)
    rate, places = MemoryRateLimiter(), MemoryConcurrencyLimiter()
    admission = Admission(Router(supervisor.pools), rate, places, quota, recorder, metrics, default_concurrency=2)
    try:
        yield World(admission, store, quota, rate, places, recorder, supervisor, metrics)
    finally:
        for instance in pool.instances:
            assert instance.client is not None
            await instance.client.close()
        await recorder.flush()
        await store.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())
