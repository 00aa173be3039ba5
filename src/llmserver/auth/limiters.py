"""Per-key limiters as named interfaces: requests per minute and requests in flight.

The in-process implementations here count one gateway's requests; an implementation shared by many
gateways (Redis) plugs in behind the same protocols. Chosen by name with `open_limiters`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Protocol

Clock = Callable[[], float]

WINDOW_SECONDS = 60.0


class RateLimiter(Protocol):
    async def hit(self, key_id: str, limit: int) -> float | None:
        """Count one request against `limit` per minute: None when it may go on, else the seconds
        until one would be allowed (nothing counted)."""
        ...

    async def wait(self, key_id: str, limit: int) -> float | None:
        """What `hit` would answer, counting nothing."""
        ...


class ConcurrencyLimiter(Protocol):
    async def acquire(self, key_id: str, limit: int) -> int | None:
        """Take one of the key's `limit` places in flight: None on success, else how many it holds."""
        ...

    def release(self, key_id: str) -> None:
        """Give a place back (from cleanup code: an implementation over the network queues it)."""
        ...

    async def held(self, key_id: str) -> int:
        """The places the key holds now."""
        ...


class MemoryRateLimiter:
    """A sliding 60-second window of request times per key."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._recent: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    async def hit(self, key_id: str, limit: int) -> float | None:
        wait = await self.wait(key_id, limit)
        if wait is None:
            self._recent[key_id].append(self._clock())
        return wait

    async def wait(self, key_id: str, limit: int) -> float | None:
        now = self._clock()
        recent = self._recent[key_id]
        while recent and recent[0] <= now - WINDOW_SECONDS:
            recent.popleft()
        return recent[0] + WINDOW_SECONDS - now if len(recent) >= limit else None


class MemoryConcurrencyLimiter:
    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()

    async def acquire(self, key_id: str, limit: int) -> int | None:
        held = self._held[key_id]
        if held >= limit:
            return held
        self._held[key_id] = held + 1
        return None

    def release(self, key_id: str) -> None:
        self._held[key_id] -= 1
        if self._held[key_id] <= 0:
            del self._held[key_id]

    async def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)


def open_limiters(name: str) -> tuple[RateLimiter, ConcurrencyLimiter]:
    """The limiters a name chooses; ValueError for one this build does not have."""
    if name == "memory":
        return MemoryRateLimiter(), MemoryConcurrencyLimiter()
    raise ValueError(f"limiters {name!r} are not supported; this build has: memory")
