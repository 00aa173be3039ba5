"""The load gateways share through Redis (cluster/sharing.py), on pools whose instances have no process
behind them: each gateway's latest load kept, stopped gateways dropped, a freed slot published before
the request that freed it ends."""

from __future__ import annotations

import asyncio

from llmserver.pool.instance import Status
from tests.support import free_port
from tests.support.pool import close, make_pool, ready_instance, run
from tests.support.services import Redis


def test_the_registry_keeps_each_gateways_latest_load_and_drops_gateways_that_stopped() -> None:
    from llmserver.cluster.registry import Registry

    async def scenario() -> None:
        pool, _ = make_pool(max_queue=8, parallel=2)
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        registry = Registry(None, {"m": pool}, None, "gw-a")  # type: ignore[arg-type]  # no Redis call here
        newer = {"gateway": "gw-b", "sequence": 5, "in_flight": {a.id: 2}, "queued": {"m": 3}}
        older = {"gateway": "gw-b", "sequence": 4, "in_flight": {}, "queued": {}}
        own = {"gateway": "gw-a", "sequence": 9, "in_flight": {b.id: 2}, "queued": {}}
        registry.load.heard([newer, own])
        assert (a.elsewhere, b.elsewhere, a.status, pool.queued_elsewhere) == (2, 0, Status.BUSY, 3)
        assert pool.share == 2  # 4 slots, 2 gateways with requests: this one's share while gw-b waits
        registry.load.heard([older], complete=True)  # a read that crossed a newer message keeps the newer
        assert a.elsewhere == 2
        registry.load.heard([], complete=True)  # gw-b's key expired: it stopped
        assert (a.elsewhere, a.status, pool.queued_elsewhere, pool.share) == (0, Status.READY, 0, None)
        await close(a, b)

    run(scenario)


def test_a_freed_slot_reaches_redis_before_the_request_ends(redis_server: Redis) -> None:
    """`Ticket.shared` (what a request's end awaits on a gateway of role `gateway`): once it returns,
    the freed slot is in this gateway's published load and on its way to the others, so a next turn
    sent at once to another gateway finds the slot free. Without it the load still shows it taken."""
    import json

    import redis.asyncio

    from llmserver.cluster import sharing
    from llmserver.cluster.records import LOAD_KEY
    from llmserver.cluster.registry import Registry

    async def published(client: redis.asyncio.Redis, gateway: str) -> dict[str, int]:
        raw = await client.get(LOAD_KEY + gateway)
        return dict(json.loads(raw)["in_flight"]) if raw else {}

    async def scenario() -> None:
        pools, registries = [], []
        for gateway in ("gw-a", "gw-b"):
            pool, _ = make_pool(parallel=2)
            pool.instances.append(await ready_instance(pool.config, 1))
            registry = Registry(redis.asyncio.Redis.from_url(redis_server.url), {"m": pool}, None, gateway)
            registry._tasks = [asyncio.create_task(task) for task in (registry.load.write(), registry.load.listen())]
            pools.append(pool)
            registries.append(registry)
        (mine, theirs), (writer, _) = pools, registries
        theirs.instances[0].id = mine.instances[0].id  # one instance, seen by both gateways
        instance = mine.instances[0]
        await asyncio.sleep(0.2)  # subscribed
        reader = redis.asyncio.Redis.from_url(redis_server.url)
        await mine.acquire("k")
        await writer.load.shared()
        assert await published(reader, "gw-a") == {instance.id: 1}
        for _ in range(100):
            if theirs.instances[0].elsewhere == 1:
                break
            await asyncio.sleep(0.01)
        assert theirs.instances[0].load == 1  # gw-b counts gw-a's request
        mine.release(instance, "k")
        assert await published(reader, "gw-a") == {instance.id: 1}  # not written yet
        await writer.load.shared()
        assert await published(reader, "gw-a") == {}
        await writer.load.shared()  # nothing changed since: at once
        # While Redis cannot be written, a request's end does not wait for it.
        working, writer.load._redis = (
            writer.load._redis,
            redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0"),
        )
        await mine.acquire("k")
        await asyncio.sleep(0.05)  # the write failed
        sharing.SHARE_WAIT = 30.0
        try:
            async with asyncio.timeout(5):
                mine.release(instance, "k")
                await writer.load.shared()
        finally:
            sharing.SHARE_WAIT = 0.1
        await reader.aclose()
        await working.aclose()
        for registry in registries:
            await registry.stop()
        for pool in pools:
            for each in pool.instances:
                assert each.client is not None
                await each.client.close()

    redis_server.flush()
    run(scenario)
