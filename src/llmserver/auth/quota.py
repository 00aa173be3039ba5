"""Token quotas per key: reserve, adjust, then settle.

Before any work, an upper bound of a request's tokens is reserved atomically in the store, held by
this gateway: concurrent requests (on any gateway sharing the store) can never overshoot a quota.
Once its inputs are known the reservation is adjusted to the tighter bound (refused if it grew past
what is left). When it ends, the reservation is settled to the real count (prompt + completion
tokens) and the rest released; a request that failed before generating releases all of it.
Counters are per period window: the UTC day, the UTC month, or one window for `total`. The clock
is injectable, for tests of rollover.

A key in a team with a quota holds two reservations, one on each counter (the team's counted under the
team's id): each is exact on its own, and a request is admitted only when both are granted (the
first is released when the second is refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.errors import APIError
from llmserver.store import KeyLimits, QuotaStore, Settlement

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
    key_id: str  # the counter's id: the key's, or its team's
    limit: int
    period: str
    window: Window
    amount: int
    settled: bool = False
    team: str | None = None  # the team's name, when the counter is a team's


def _counters(principal: Principal) -> list[tuple[str, KeyLimits, str | None]]:
    """The quota counters a request of this key draws on: its own, then its team's."""
    counters: list[tuple[str, KeyLimits, str | None]] = [(principal.key_id, principal.limits, None)]
    if principal.team is not None:
        counters.append((principal.team.id, principal.team.limits, principal.team.name))
    return [c for c in counters if c[1].quota_tokens is not None and c[1].quota_period is not None]


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
    def __init__(self, store: QuotaStore, gateway_id: str, clock: Clock = time.time) -> None:
        self._store = store
        self.gateway_id = gateway_id
        self._clock = clock

    async def reserve(self, principal: Principal, amount: int) -> list[Reservation]:
        """Reserve `amount` tokens on the key's quota and its team's (none when neither has one)."""
        held: list[Reservation] = []
        now = self._clock()
        for counter, limits, team in _counters(principal):
            assert limits.quota_tokens is not None and limits.quota_period is not None
            current = window(limits.quota_period, now)
            reservation = Reservation(counter, limits.quota_tokens, limits.quota_period, current, 0, team=team)
            try:
                await self._grow(reservation, amount)
            except BaseException:
                for taken in held:
                    await self._store.quota_release(taken.key_id, taken.window.start, self.gateway_id, taken.amount)
                raise
            held.append(reservation)
        return held

    async def adjust(self, reservations: list[Reservation], amount: int) -> None:
        """Hold `amount` instead: release the difference, or reserve more (429 if that does not fit; what
        was held stays held until the request closes and is settled)."""
        for reservation in reservations:
            if reservation.settled or amount == reservation.amount:
                continue
            if amount < reservation.amount:
                await self._store.quota_release(
                    reservation.key_id, reservation.window.start, self.gateway_id, reservation.amount - amount
                )
                reservation.amount = amount
                continue
            await self._grow(reservation, amount - reservation.amount)

    async def _grow(self, reservation: Reservation, more: int) -> None:
        grant = await self._store.quota_reserve(
            reservation.key_id, reservation.window.start, self.gateway_id, more, reservation.limit
        )
        if not grant.granted:
            held = reservation.amount
            raise self._refusal(reservation, held + more, grant.used + grant.reserved - held, grant.reserved - held)
        reservation.amount += more

    def _refusal(self, reservation: Reservation, wanted: int, taken: int, held: int = 0) -> InsufficientQuota:
        left = max(0, reservation.limit - taken)
        whose = "This API key's token quota"
        if reservation.team is not None:
            whose = f"The token quota of this API key's team {reservation.team!r}"
        message = (
            f"{whose} ({reservation.limit} per {reservation.period}) cannot cover this "
            f"request: it may use up to {wanted} tokens and {left} are left"
        )
        resets_at = reservation.window.resets_at
        if held > 0 and wanted <= reservation.limit - (taken - held):
            # What blocks it is held by the key's requests in flight, settled (most of it given back) as
            # they end: a retry then may well succeed, whatever the period.
            message += (
                f"; {held} of them are held by {'this key' if reservation.team is None else 'the team'}'s requests"
                " in flight until they end (each holds what it "
                "may use and is charged what it used): retry when one has finished"
            )
            resets = f" (the quota resets at {resets_at.isoformat()})" if resets_at is not None else ""
            return InsufficientQuota(f"{message}{resets}.", headers={"Retry-After": "1"})
        headers = {}
        if resets_at is not None:
            message += f"; the quota resets at {resets_at.isoformat()}."
            headers["Retry-After"] = str(max(1, int(resets_at.timestamp() - self._clock())))
        else:
            message += "; a total quota does not reset."
        return InsufficientQuota(message, headers=headers)

    def settlements(self, reservations: list[Reservation], used: int) -> list[Settlement]:
        """The writes that charge the real count and release the reservations (once), for the usage batch."""
        writes = []
        for reservation in reservations:
            if reservation.settled:
                continue
            reservation.settled = True
            writes.append(
                Settlement(
                    reservation.key_id, reservation.window.start, self.gateway_id, reservation.amount, max(0, used)
                )
            )
        return writes

    async def standing(self, key_id: str, limits: KeyLimits) -> dict[str, Any] | None:
        """Where a key stands in its quota's current window (None: no quota): what the console shows."""
        if limits.quota_tokens is None or limits.quota_period is None:
            return None
        current = window(limits.quota_period, self._clock())
        used, reserved = await self._store.quota_counts(key_id, current.start)
        return {
            "limit": limits.quota_tokens,
            "period": limits.quota_period,
            "window": current.start,
            "used": used,
            "reserved": reserved,  # held by requests in flight, on every gateway
            "left": max(0, limits.quota_tokens - used - reserved),
            "resets_at": current.resets_at.isoformat() if current.resets_at is not None else None,
        }

    async def exhausted(self, principal: Principal) -> None:
        """429 when the key's quota or its team's has nothing left in this window (a check that needs no
        request)."""
        now = self._clock()
        for counter, limits, team in _counters(principal):
            assert limits.quota_tokens is not None and limits.quota_period is not None
            current = window(limits.quota_period, now)
            used, reserved = await self._store.quota_counts(counter, current.start)
            if used + reserved >= limits.quota_tokens:
                reservation = Reservation(counter, limits.quota_tokens, limits.quota_period, current, 0, team=team)
                raise self._refusal(reservation, 1, used + reserved)

    async def headers(self, principal: Principal) -> dict[str, str]:
        """x-ratelimit-*-tokens for a key with a quota."""
        limits = principal.limits
        if limits.quota_tokens is None or limits.quota_period is None:
            return {}
        now = self._clock()
        current = window(limits.quota_period, now)
        used, reserved = await self._store.quota_counts(principal.key_id, current.start)
        result = {
            "x-ratelimit-limit-tokens": str(limits.quota_tokens),
            "x-ratelimit-remaining-tokens": str(max(0, limits.quota_tokens - used - reserved)),
        }
        if current.resets_at is not None:
            result["x-ratelimit-reset-tokens"] = f"{max(0, int(current.resets_at.timestamp() - now))}s"
        return result
