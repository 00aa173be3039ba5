"""The limiters: a sliding requests-per-minute window and requests in flight, in process and shared
by several gateways on a real Redis (restarted, emptied, and stopped under them)."""

from __future__ import annotations

import asyncio

import pytest

from llmserver.auth.limiters import MemoryConcurrencyLimiter, MemoryRateLimiter, RedisLimits, open_limiters
from llmserver.errors import StateUnavailable
from tests.support.services import Redis


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide() -> None:
    async def scenario() -> None:
        clock = Clock()
        rate = MemoryRateLimiter(clock)
        assert await rate.hit("k", 2) is None
        clock.now += 10
        assert await rate.hit("k", 2) is None
        assert await rate.wait("k", 2) == pytest.approx(50.0)  # the first one leaves the window in 50 s
        assert await rate.hit("k", 2) == pytest.approx(50.0)
        assert await rate.hit("other", 2) is None  # per key
        clock.now += 50
        assert await rate.hit("k", 2) is None  # refused requests were not counted

    asyncio.run(scenario())


def test_concurrency_places_are_given_back() -> None:
    async def scenario() -> None:
        places = MemoryConcurrencyLimiter()
        assert await places.acquire("k", 2) is None
        assert await places.acquire("k", 2) is None
        assert await places.acquire("k", 2) == 2
        places.release("k")
        assert await places.acquire("k", 2) is None
        places.release("k")
        places.release("k")
        assert await places.held("k") == 0

    asyncio.run(scenario())


def test_limiters_by_url() -> None:
    rate, concurrency, shared = open_limiters("", "gw1")
    assert isinstance(rate, MemoryRateLimiter) and isinstance(concurrency, MemoryConcurrencyLimiter)
    assert shared is None
    with pytest.raises(ValueError):
        open_limiters("carrier-pigeon://x", "gw1")


def shared_limits(redis_server: Redis, *gateways: str) -> list[RedisLimits]:
    limits = []
    for gateway in gateways:
        _, _, shared = open_limiters(redis_server.url, gateway)
        assert shared is not None
        limits.append(shared)
    return limits


def test_shared_rpm_admits_exactly_the_limit_across_gateways(redis_server: Redis) -> None:
    async def scenario() -> None:
        a, b = shared_limits(redis_server, "gw-a", "gw-b")
        answers = await asyncio.gather(*((a if i % 2 else b).hit("rpm-key", 10) for i in range(30)))
        assert sum(answer is None for answer in answers) == 10
        waits = [answer for answer in answers if answer is not None]
        assert all(0 < wait <= 60 for wait in waits)
        assert await a.wait("rpm-key", 10) is not None and await b.wait("rpm-key", 11) is None
        for limits in (a, b):
            await limits.close()

    redis_server.flush()
    asyncio.run(scenario())


def test_shared_places_in_flight_across_gateways_and_after_a_redis_restart(redis_server: Redis) -> None:
    async def scenario() -> None:
        a, b = shared_limits(redis_server, "gw-a", "gw-b")
        taken = await asyncio.gather(*((a if i % 2 else b).acquire("c-key", 3) for i in range(8)))
        assert sum(answer is None for answer in taken) == 3
        assert await b.held("c-key") == 3
        redis_server.flush()  # Redis restarted empty: its counts are gone ...
        assert await a.held("c-key") == 0
        await a.resync()  # ... and every gateway's heartbeat writes its own again
        await b.resync()
        assert await a.held("c-key") == 3
        holder = a if a._mine["c-key"] else b
        holder.release("c-key")
        await asyncio.sleep(0.1)
        assert await a.held("c-key") == 2
        # A gateway that died: its places are forgotten when its lease is swept.
        await a.forget_gateway("gw-b")
        assert await a.held("c-key") == a._mine["c-key"]
        for limits in (a, b):
            await limits.close()

    redis_server.flush()
    asyncio.run(scenario())


def test_shared_limits_fail_closed_while_redis_is_down_and_recover() -> None:
    server = Redis().start()
    try:

        async def scenario() -> None:
            (limits,) = shared_limits(server, "gw-a")
            assert await limits.acquire("k", 2) is None
            server.stop()
            for call in (limits.hit("k", 5), limits.acquire("k", 2), limits.held("k")):
                with pytest.raises(StateUnavailable) as caught:
                    await call
                assert caught.value.status == 503 and caught.value.type == "overloaded_error"
                assert caught.value.headers["Retry-After"] == "2"
            limits.release("k")  # cannot be sent: the heartbeat's resync puts it right
            await asyncio.sleep(0.1)
            server.start()
            await limits.resync()
            assert await limits.held("k") == 0 and await limits.hit("k", 5) is None
            await limits.close()

        asyncio.run(scenario())
    finally:
        server.stop()
