"""The 30-day rolling tokens/s per model, from per-minute buckets of successful requests.

Each bucket holds completion tokens and request seconds (whole latency, as the native API's
tokens_per_second), so the average estimates how long a request will take. The buckets are persisted;
the totals live in memory, so reading /v1/models never scans anything.
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

    async def load(self) -> None:
        """The last 30 days' buckets from the store (at start-up)."""
        for model, minute, tokens, seconds in await self._store.speed_since(self._minute() - WINDOW_MINUTES):
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
        return (model, minute, float(tokens), seconds)

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
