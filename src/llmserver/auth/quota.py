"""Token quotas (reserve, then settle) and requests-per-minute limits, per key.

Before a request is dispatched, an upper bound of its tokens (prompt bound + max_tokens) is reserved
atomically in the store: concurrent requests can never overshoot a quota. When it ends, the
reservation is settled to the real count (prompt + completion tokens) and the rest released; a
request that failed before generating releases all of it. Counters are per period window: the UTC
day, the UTC month, or one window for `total`. The clock is injectable, for tests of rollover.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from llmserver.auth.keys import Principal
from llmserver.errors import APIError, RateLimited
from llmserver.store import SQLiteStore

Clock = Callable[[], float]


class InsufficientQuota(APIError):
    status = 429
    type = "insufficient_quota"


@dataclass(frozen=True)
class Window:
    start: str  # the counters' row key
    resets_at: datetime | None  # None for total quotas


@dataclass
class Reservation:
    key_id: str
    window: Window
    amount: int
    settled: bool = False


def window(period: str, now: float) -> Window:
    moment = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return Window(start.date().isoformat(), start + timedelta(days=1))
    if period == "month":
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        following = (start + timedelta(days=32)).replace(day=1)
        return Window(start.date().isoformat()[:7], following)
    return Window("total", None)


class QuotaService:
    def __init__(self, store: SQLiteStore, clock: Clock = time.time) -> None:
        self._store = store
        self._clock = clock
        self._minute: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def check_rate(self, principal: Principal) -> None:
        """The requests-per-minute limit (a sliding 60 s window, in memory)."""
        rpm = principal.limits.rpm
        if rpm is None:
            return
        now = self._clock()
        recent = self._minute[principal.key_id]
        while recent and recent[0] <= now - 60:
            recent.popleft()
        if len(recent) >= rpm:
            retry = max(1, int(recent[0] + 60 - now) + 1)
            raise RateLimited(f"This API key is limited to {rpm} requests per minute.", retry_after=retry)
        recent.append(now)

    def reserve(self, principal: Principal, amount: int) -> Reservation | None:
        """Reserve `amount` tokens of the key's quota; None when the key has no quota."""
        limits = principal.limits
        if limits.quota_tokens is None or limits.quota_period is None:
            return None
        current = window(limits.quota_period, self._clock())
        granted, used, reserved = self._store.quota_reserve(
            principal.key_id, current.start, amount, limits.quota_tokens
        )
        if not granted:
            left = max(0, limits.quota_tokens - used - reserved)
            message = (
                f"This API key's token quota ({limits.quota_tokens} per {limits.quota_period}) cannot cover this "
                f"request: it may use up to {amount} tokens and {left} are left"
            )
            headers = {}
            if current.resets_at is not None:
                message += f"; the quota resets at {current.resets_at.isoformat()}."
                headers["Retry-After"] = str(max(1, int(current.resets_at.timestamp() - self._clock())))
            else:
                message += "; a total quota does not reset."
            raise InsufficientQuota(message, headers=headers)
        return Reservation(principal.key_id, current, amount)

    def settle(self, reservation: Reservation | None, used: int) -> None:
        """Charge the real count and release the rest (idempotent)."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self._store.quota_settle(reservation.key_id, reservation.window.start, reservation.amount, max(0, used))

    def headers(self, principal: Principal) -> dict[str, str]:
        """x-ratelimit-*-tokens for a key with a quota."""
        limits = principal.limits
        if limits.quota_tokens is None or limits.quota_period is None:
            return {}
        now = self._clock()
        current = window(limits.quota_period, now)
        used, reserved = self._store.quota_counts(principal.key_id, current.start)
        result = {
            "x-ratelimit-limit-tokens": str(limits.quota_tokens),
            "x-ratelimit-remaining-tokens": str(max(0, limits.quota_tokens - used - reserved)),
        }
        if current.resets_at is not None:
            result["x-ratelimit-reset-tokens"] = f"{max(0, int(current.resets_at.timestamp() - now))}s"
        return result
