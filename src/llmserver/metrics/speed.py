"""The 30-day rolling tokens/s per model, from per-minute buckets of successful requests.

Each bucket holds completion tokens and request seconds (whole latency, as the native API's
tokens_per_second), so the average estimates how long a request will take. The buckets are persisted;
the totals live in memory, so reading /v1/models never scans anything. Gateways sharing a store see
each other's traffic through `refresh()` (on every lease heartbeat): the minutes since the last
refresh are read again from the store, after this gateway's own increments were written.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from llmserver.store import UsageStore

WINDOW_MINUTES = 30 * 24 * 60


class RollingSpeed:
    def __init__(self, store: UsageStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._buckets: dict[str, collections.OrderedDict[int, list[float]]] = collections.defaultdict(
            collections.OrderedDict
        )
        self._totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        self._refreshed: int | None = None  # the minute of the last load or refresh
        self._during: list[tuple[str, int, float, float]] | None = None

    async def load(self) -> None:
        """The last 30 days' buckets from the store (at start-up)."""
        self._refreshed = self._minute()
        for model, minute, tokens, seconds in await self._store.speed_since(self._minute() - WINDOW_MINUTES):
            self._add_memory(model, minute, tokens, seconds)

    async def refresh(self) -> None:
        """Read the buckets of the minutes since the last refresh again, other gateways' increments
        included. The caller has flushed this gateway's own writes first, so nothing counts twice."""
        if self._refreshed is None:
            await self.load()
            return
        since, self._refreshed = self._refreshed - 1, self._minute()
        self._during = []
        try:
            rows = await self._store.speed_since(since, prune=False)
        finally:
            during, self._during = self._during, None
        for model, buckets in self._buckets.items():
            total = self._totals[model]
            for minute in [m for m in buckets if m >= since]:
                tokens, seconds = buckets.pop(minute)
                total[0] -= tokens
                total[1] -= seconds
        for model, minute, tokens, seconds in rows:
            self._add_memory(model, minute, tokens, seconds)
        for model, minute, tokens, seconds in during:  # added while the store was being read: not in rows
            self._add_memory(model, minute, tokens, seconds)

    def _minute(self) -> int:
        return int(self._clock() // 60)

    def _add_memory(self, model: str, minute: int, tokens: float, seconds: float) -> None:
        bucket = self._buckets[model].setdefault(minute, [0.0, 0.0])
        bucket[0] += tokens
        bucket[1] += seconds
        total = self._totals[model]
        total[0] += tokens
        total[1] += seconds

    def add(self, model: str, tokens: int, seconds: float) -> tuple[str, int, float, float] | None:
        """Count a successful request; the bucket increment for the caller to persist (None: nothing)."""
        if tokens <= 0 or seconds <= 0:
            return None
        minute = self._minute()
        self._add_memory(model, minute, tokens, seconds)
        if self._during is not None:
            self._during.append((model, minute, float(tokens), seconds))
        return (model, minute, float(tokens), seconds)

    def recent(self, model: str, minutes: int = 5) -> float | None:
        """tokens/s of the successful requests that ended in the last `minutes` (the current one
        included); None when there were none."""
        oldest = self._minute() - minutes
        buckets = self._buckets.get(model) or collections.OrderedDict()
        tokens = seconds = 0.0
        for minute in reversed(buckets):  # in minute order: only the newest few are read
            if minute <= oldest:
                break
            tokens, seconds = tokens + buckets[minute][0], seconds + buckets[minute][1]
        return round(tokens / seconds, 2) if seconds > 0 else None

    def average(self, model: str) -> float | None:
        """tokens/s over the last 30 days; None while the model has no successful requests."""
        oldest = self._minute() - WINDOW_MINUTES
        buckets = self._buckets.get(model)
        if not buckets:
            return None
        total = self._totals[model]
        while buckets and next(iter(buckets)) < oldest:
            _, (tokens, seconds) = buckets.popitem(last=False)
            total[0] -= tokens
            total[1] -= seconds
        if not buckets or total[1] <= 0:
            return None
        return round(total[0] / total[1], 2)
