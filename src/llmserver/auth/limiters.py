"""Per-key limiters as named interfaces: requests per minute and requests in flight.

The in-process implementations count one gateway's requests. `RedisLimits` counts the requests of
every gateway that shares one Redis, each check and count one atomic Lua script on Redis's own clock,
so that a key's rpm or max_concurrency holds for the whole deployment. When Redis cannot be reached
those limits fail closed: 503 `overloaded_error` with Retry-After (logged once per outage). Redis
holds soft state only: each gateway keeps its own count of the places it holds and writes it again on
every lease heartbeat, so a restarted (emptied) Redis is right again within a heartbeat, and a
gateway that died is forgotten when its lease is swept. Chosen with `open_limiters(redis_url)`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from llmserver.errors import StateUnavailable
from llmserver.outage import Outage, redis_unreachable

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger(__name__)
T = TypeVar("T")

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
        self._held: dict[str, int] = {}  # a plain dict: a Counter's missing keys and deletions are Python calls

    async def acquire(self, key_id: str, limit: int) -> int | None:
        held = self._held.get(key_id, 0)
        if held >= limit:
            return held
        self._held[key_id] = held + 1
        return None

    def release(self, key_id: str) -> None:
        left = self._held.pop(key_id, 0) - 1
        if left > 0:
            self._held[key_id] = left

    async def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)


PREFIX = "llmserver"
PLACES_TTL = 3600  # seconds: a key's in-flight hash outlives a forgotten release by at most this long

# KEYS: the key's window (a sorted set of request times, ms). ARGV: limit, window ms, a unique
# member, 1 to count the request or 0 to only ask. The answer: -1 when allowed, else ms to wait.
RATE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(oldest[2]) + window - now)
end
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
end
return -1
"""

# KEYS: the key's places (a hash: gateway id -> places it holds), the gateway's set of keys it holds
# places of. ARGV: limit, gateway id, key id, ttl. The answer: -1 when taken, else the places held.
ACQUIRE_SCRIPT = """
local held = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do held = held + tonumber(v) end
if held >= tonumber(ARGV[1]) then return held end
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return -1
"""

RELEASE_SCRIPT = """
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""

HELD_SCRIPT = """
local held = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do held = held + tonumber(v) end
return held
"""


class RedisLimits:
    """Requests per minute and places in flight, per key, for every gateway on one Redis."""

    def __init__(self, client: redis.asyncio.Redis, gateway_id: str) -> None:
        self._redis = client
        self.client = client
        self.gateway_id = gateway_id
        self._rate = client.register_script(RATE_SCRIPT)
        self._acquire = client.register_script(ACQUIRE_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._held = client.register_script(HELD_SCRIPT)
        self._mine: collections.Counter[str] = collections.Counter()  # places this gateway holds, per key
        self._dirty: set[str] = set()  # keys whose count changed since Redis last heard it
        self._members = itertools.count()
        self._outage = Outage(log)
        self._releases: set[asyncio.Task[None]] = set()

    @staticmethod
    def _places_key(key_id: str) -> str:
        return f"{PREFIX}:places:{key_id}"

    def _gateway_key(self, gateway_id: str | None = None) -> str:
        return f"{PREFIX}:gateway:{gateway_id or self.gateway_id}:keys"

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            result = await call
        except redis_unreachable() as exc:
            self._outage.failed("Redis cannot be reached (%s): keys with rpm or max_concurrency get 503", exc)
            raise StateUnavailable(
                "The shared rate limits cannot be checked (Redis is unreachable); retry shortly.", retry_after=2
            ) from exc
        self._outage.recovered("Redis answers again: shared limits are counted again")
        return result

    async def hit(self, key_id: str, limit: int) -> float | None:
        return await self._window(key_id, limit, count=True)

    async def wait(self, key_id: str, limit: int) -> float | None:
        return await self._window(key_id, limit, count=False)

    async def _window(self, key_id: str, limit: int, *, count: bool) -> float | None:
        member = f"{self.gateway_id}:{next(self._members)}"
        args: list[Any] = [limit, int(WINDOW_SECONDS * 1000), member, 1 if count else 0]
        wait_ms = int(await self._call(self._rate(keys=[f"{PREFIX}:rpm:{key_id}"], args=args)))
        return None if wait_ms < 0 else wait_ms / 1000

    async def acquire(self, key_id: str, limit: int) -> int | None:
        keys = [self._places_key(key_id), self._gateway_key()]
        held = int(await self._call(self._acquire(keys=keys, args=[limit, self.gateway_id, key_id, PLACES_TTL])))
        if held >= 0:
            return held
        self._mine[key_id] += 1
        self._dirty.add(key_id)
        return None

    def release(self, key_id: str) -> None:
        if self._mine[key_id] <= 1:
            del self._mine[key_id]
        else:
            self._mine[key_id] -= 1
        task = asyncio.get_running_loop().create_task(self._give_back(key_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _give_back(self, key_id: str) -> None:
        try:
            await self._call(self._release(keys=[self._places_key(key_id)], args=[self.gateway_id]))
        except StateUnavailable:
            pass  # the next heartbeat writes this gateway's count again (`resync`)
        else:
            if key_id not in self._mine:
                self._dirty.discard(key_id)

    async def held(self, key_id: str) -> int:
        return int(await self._call(self._held(keys=[self._places_key(key_id)], args=[])))

    async def resync(self) -> None:
        """Write this gateway's places again (on each heartbeat): right after a Redis restart or a
        release that could not be sent."""
        keys = set(self._mine) | self._dirty
        if not keys:
            return
        pipe = self._redis.pipeline(transaction=True)
        for key_id in sorted(keys):
            places = self._mine.get(key_id, 0)
            if places:
                pipe.hset(self._places_key(key_id), self.gateway_id, places)
                pipe.expire(self._places_key(key_id), PLACES_TTL)
                pipe.sadd(self._gateway_key(), key_id)
            else:
                pipe.hdel(self._places_key(key_id), self.gateway_id)
        pipe.expire(self._gateway_key(), PLACES_TTL)
        await self._call(pipe.execute())
        self._dirty -= keys - set(self._mine)

    async def forget_gateway(self, gateway_id: str) -> None:
        """A gateway that died holds no places any more."""
        held = await self._call(self._redis.smembers(self._gateway_key(gateway_id)))
        pipe = self._redis.pipeline(transaction=True)
        for key_id in held:
            pipe.hdel(self._places_key(key_id.decode() if isinstance(key_id, bytes) else key_id), gateway_id)
        pipe.delete(self._gateway_key(gateway_id))
        await self._call(pipe.execute())

    async def close(self) -> None:
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=2)
        await self._redis.aclose()


def connect_redis(url: str) -> redis.asyncio.Redis:
    """A Redis client for soft state, shared by the limiters and the instance registry: 2-second
    timeouts, and one retry on a fresh connection (after a Redis restart the pooled ones are stale)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[RedisConnectionError],
    )


def open_limiters(redis_url: str, gateway_id: str) -> tuple[RateLimiter, ConcurrencyLimiter, RedisLimits | None]:
    """The in-process limiters, or with a Redis URL the shared ones (also returned third, for their
    heartbeat work); ValueError for a URL Redis's client does not take."""
    if not redis_url:
        return MemoryRateLimiter(), MemoryConcurrencyLimiter(), None
    client = connect_redis(redis_url)
    shared = RedisLimits(client, gateway_id)
    return shared, shared, shared
