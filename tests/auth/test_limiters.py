"""The in-process limiters: a sliding requests-per-minute window and requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from llmserver.auth.limiters import MemoryConcurrencyLimiter, MemoryRateLimiter, open_limiters


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


def test_limiters_by_name() -> None:
    rate, concurrency = open_limiters("memory")
    assert isinstance(rate, MemoryRateLimiter) and isinstance(concurrency, MemoryConcurrencyLimiter)
    with pytest.raises(ValueError, match="not supported"):
        open_limiters("carrier-pigeon")
