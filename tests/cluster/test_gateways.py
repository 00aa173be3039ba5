"""Gateway leases on each store engine: taking one, waiting for a live holder, taking over from a dead
one at once, the heartbeat's progress writes, and the sweep of a gateway that stopped renewing."""

from __future__ import annotations

import asyncio
import os

import pytest

from llmserver.cluster.gateways import GatewayIdInUse, GatewayLease
from llmserver.metrics.speed import RollingSpeed
from llmserver.store import Store, UsageBatch, open_store


def lease(store: Store, gateway: str, seconds: float = 1.0, **options: object) -> GatewayLease:
    return GatewayLease(store, store, gateway, lease=seconds, job_ttl=60.0, produced=dict, **options)  # type: ignore[arg-type]


def test_an_id_held_by_a_live_process_is_refused_and_a_dead_ones_is_taken_at_once(database_url: str) -> None:
    async def scenario() -> None:
        store = await open_store(database_url)
        first = lease(store, "gw", seconds=1.0)
        await first.start()
        # Another live process on this host holds it (and renews it): after two lease periods, a clear error.
        second = lease(store, "gw", seconds=1.0)
        second.pid = os.getpid() + 1_000_000  # not this process; `kill -0` would fail, so pretend it is alive:
        second._mine_or_dead = lambda holder: False  # type: ignore[method-assign]
        with pytest.raises(GatewayIdInUse, match="give every gateway that shares the database its own"):
            await second.start()
        # The holder died (kill -9: no release, its lease still runs): a new process on the same host
        # takes over at once.
        assert first._task is not None
        first._task.cancel()
        holder = await store.gateway_holder("gw")
        assert holder is not None
        await store.gateway_take("gw", holder.host, 2**22 + 7, 30.0, holder)  # a pid that is not running
        third = lease(store, "gw", seconds=30.0)
        started = asyncio.get_running_loop().time()
        await third.start()
        assert asyncio.get_running_loop().time() - started < 0.5
        await third.stop()
        assert await store.gateway_holder("gw") is None
        await store.close()

    asyncio.run(scenario())


def test_the_heartbeat_writes_progress_and_a_live_gateway_sweeps_a_dead_one(database_url: str) -> None:
    async def scenario() -> None:
        store = await open_store(database_url)
        produced: dict[tuple[str, str], int] = {}
        dead = GatewayLease(store, store, "dead", lease=0.5, job_ttl=60.0, produced=lambda: dict(produced))
        await dead.start()
        await store.quota_reserve("k", "total", "dead", 100, 1000)
        await store.insert_job("job-of-dead", "k", "n", 1.0, "dead")
        produced[("k", "total")] = 37
        await dead.beat()
        dead._task.cancel()  # type: ignore[union-attr]  # it dies: no more renewals, no release
        forgotten: list[str] = []

        async def forget(gateway: str) -> None:
            forgotten.append(gateway)

        live = GatewayLease(store, store, "live", lease=0.5, job_ttl=60.0, produced=dict, on_sweep=forget)
        await live.start()
        for _ in range(40):
            await asyncio.sleep(0.1)
            if forgotten:
                break
        assert forgotten == ["dead"]
        assert await store.quota_counts("k", "total") == (37, 0)  # charged what it had produced, nothing held
        job = await store.job("job-of-dead", "k", 2.0)
        assert job is not None and job.status == "failed"
        await live.stop()
        await store.close()

    asyncio.run(scenario())


def test_speed_averages_include_other_gateways_after_a_refresh(database_url: str) -> None:
    async def scenario() -> None:
        store = await open_store(database_url)
        mine, theirs = RollingSpeed(store), RollingSpeed(store)
        await mine.load()
        await theirs.load()
        increment = theirs.add("m", 100, 2.0)  # 50 tokens/s on the other gateway, written by its recorder
        assert increment is not None
        await store.record(UsageBatch(speeds=[increment]))
        assert mine.average("m") is None
        own = mine.add("m", 10, 1.0)
        assert own is not None
        await store.record(UsageBatch(speeds=[own]))
        await mine.refresh()
        assert mine.average("m") == round(110 / 3.0, 2)
        await mine.refresh()  # again: nothing counted twice
        assert mine.average("m") == round(110 / 3.0, 2)
        await store.close()

    asyncio.run(scenario())
