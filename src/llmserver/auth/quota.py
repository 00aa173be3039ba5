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

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.errors import APIError
from llmserver.store import Alert, KeyLimits, QuotaStore, Settlement

Clock = Callable[[], float]


class InsufficientQuota(APIError):
    status = 429
    type = "insufficient_quota"


@dataclass(frozen=True)
class Window:
    start: str  # the counters' row key
    resets_at: datetime | None  # None for total quotas


MONEY = "/money"  # a budget's counter: its key's or team's id, then this
NANO = 1_000_000_000  # a budget is counted in billionths of billing.currency


@dataclass(frozen=True)
class Counter:
    """One limit a request draws on: a token quota or a budget in money, of its key or of its team."""

    id: str  # the counter's row key: the key's or team's id (with MONEY after it for a budget)
    limit: int  # tokens, or billionths
    period: str
    team: str | None  # the team's name, when the counter is a team's
    budget: float | None = None  # a budget's, in billing.currency (None: a token quota)


@dataclass
class Reservation:
    key_id: str  # the counter's id: the key's, or its team's
    limit: int
    period: str
    window: Window
    amount: int  # in the counter's units: tokens, or billionths
    settled: bool = False
    team: str | None = None  # the team's name, when the counter is a team's
    per_token: int = 0  # a budget's: the most a prompt token may cost, in billionths (0: a token quota)
    per_completion: int = 0  # a budget's: what a completion token costs, in billionths
    completion: int = 0  # how many of the tokens it holds for are its max_tokens (completion)
    budget: float | None = None

    def units(self, tokens: int) -> int:
        """What `tokens` (its completion among them) hold on this counter: tokens, or their most cost."""
        if self.budget is None:
            return tokens
        completion = min(self.completion, tokens)
        return (tokens - completion) * self.per_token + completion * self.per_completion


def _counters(principal: Principal, priced: bool = False) -> list[Counter]:
    """The counters a request of this key draws on, its own before its team's: token quotas, and budgets
    when its model has prices (a model without prices costs nothing)."""
    owners: list[tuple[str, KeyLimits, str | None]] = [(principal.key_id, principal.limits, None)]
    if principal.team is not None:
        owners.append((principal.team.id, principal.team.limits, principal.team.name))
    counters = []
    for owner, limits, team in owners:
        if limits.quota_tokens is not None and limits.quota_period is not None:
            counters.append(Counter(owner, limits.quota_tokens, limits.quota_period, team))
        if priced and limits.budget is not None and limits.budget_period is not None:
            counters.append(
                Counter(owner + MONEY, round(limits.budget * NANO), limits.budget_period, team, limits.budget)
            )
    return counters


def per_token(price: float) -> int:
    """One token at `price` per million tokens, in billionths (rounded up)."""
    return math.ceil(price * NANO / 1e6)


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
    def __init__(
        self,
        store: QuotaStore,
        gateway_id: str,
        clock: Clock = time.time,
        *,
        currency: str = "USD",
        thresholds: tuple[int, ...] = (),
        webhook: str | None = None,
    ) -> None:
        self._store = store
        self.currency = currency
        self.thresholds = thresholds  # percentages of a budget whose crossing is reported (billing.budget_alerts)
        self.webhook = webhook  # where it is POSTed (billing.budget_webhook)
        self.gateway_id = gateway_id
        self._clock = clock

    async def reserve(
        self, principal: Principal, amount: int, price: tuple[float, float] | None = None, completion: int = 0
    ) -> list[Reservation]:
        """Reserve `amount` tokens on the key's quota and its team's, and on their budgets what they may
        cost at `price` (the most a prompt token and a completion token of the model cost, per million;
        None: the model has no prices), `completion` of them at the second; 429 for the first counter
        that cannot cover it."""
        held: list[Reservation] = []
        now = self._clock()
        for counter in _counters(principal, price is not None):
            money = counter.budget is not None and price is not None
            reservation = Reservation(
                counter.id, counter.limit, counter.period, window(counter.period, now), 0, team=counter.team,
                per_token=per_token(price[0]) if money and price else 0,
                per_completion=per_token(price[1]) if money and price else 0,
                completion=completion, budget=counter.budget,
            )  # fmt: skip
            try:
                await self._grow(reservation, reservation.units(amount))
            except BaseException:
                for taken in held:
                    await self._store.quota_release(taken.key_id, taken.window.start, self.gateway_id, taken.amount)
                raise
            held.append(reservation)
        return held

    async def adjust(self, reservations: list[Reservation], amount: int) -> None:
        """Hold `amount` tokens instead: release the difference, or reserve more (429 if that does not fit;
        what was held stays held until the request closes and is settled)."""
        for reservation in reservations:
            wanted = reservation.units(amount)
            if reservation.settled or wanted == reservation.amount:
                continue
            if wanted < reservation.amount:
                await self._store.quota_release(
                    reservation.key_id, reservation.window.start, self.gateway_id, reservation.amount - wanted
                )
                reservation.amount = wanted
                continue
            await self._grow(reservation, wanted - reservation.amount)

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
        what = "token quota" if reservation.budget is None else "budget"
        whose = f"This API key's {what}"
        if reservation.team is not None:
            whose = f"The {what} of this API key's team {reservation.team!r}"
        if reservation.budget is None:
            size, asked = f"{reservation.limit}", f"use up to {wanted} tokens and {left} are left"
        else:
            size = f"{reservation.budget:g} {self.currency}"
            asked = f"cost up to {wanted / NANO:.6f} {self.currency} and {left / NANO:.6f} are left"
        message = f"{whose} ({size} per {reservation.period}) cannot cover this request: it may {asked}"
        resets_at = reservation.window.resets_at
        if held > 0 and wanted <= reservation.limit - (taken - held):
            # What blocks it is held by the key's requests in flight, settled (most of it given back) as
            # they end: a retry then may well succeed, whatever the period.
            amount = f"{held}" if reservation.budget is None else f"{held / NANO:.6f} {self.currency}"
            message += (
                f"; {amount} of them are held by {'this key' if reservation.team is None else 'the team'}'s requests"
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

    def settlements(self, reservations: list[Reservation], used: int, cost: float | None = None) -> list[Settlement]:
        """The writes that charge the real count (`used` tokens; `cost` on budgets) and release the
        reservations (once), for the usage batch; a budget's crossed thresholds are reported by the store."""
        writes = []
        for reservation in reservations:
            if reservation.settled:
                continue
            reservation.settled = True
            charged = max(0, used) if reservation.budget is None else max(0, round((cost or 0.0) * NANO))
            writes.append(
                Settlement(
                    reservation.key_id,
                    reservation.window.start,
                    self.gateway_id,
                    reservation.amount,
                    charged,
                    alerts=self._alerts(reservation),
                )
            )
        return writes

    def _alerts(self, reservation: Reservation) -> tuple[Alert, ...]:
        """A budget's thresholds (billing.budget_alerts), each with what its webhook says when crossed."""
        if reservation.budget is None or not self.thresholds:
            return ()
        owner = reservation.key_id.removesuffix(MONEY)
        kind = "team" if reservation.team is not None else "key"
        alerts = []
        for pct in self.thresholds:
            payload = {
                "type": "budget.threshold", "owner": kind, "id": owner, "team": reservation.team,
                "threshold": pct, "budget": reservation.budget, "currency": self.currency,
                "period": reservation.period, "window": reservation.window.start,
            }  # fmt: skip
            mark = math.ceil(reservation.limit * pct / 100)
            alerts.append(Alert(mark, self.webhook, json.dumps(payload), kind, pct))
        return tuple(alerts)

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

    async def budget_standing(self, owner_id: str, limits: KeyLimits) -> dict[str, Any] | None:
        """Where a key's or team's budget stands in its current window (None: no budget), in billing.currency."""
        if limits.budget is None or limits.budget_period is None:
            return None
        current = window(limits.budget_period, self._clock())
        used, reserved = await self._store.quota_counts(owner_id + MONEY, current.start)
        return {
            "budget": limits.budget,
            "currency": self.currency,
            "period": limits.budget_period,
            "window": current.start,
            "spent": used / NANO,
            "reserved": reserved / NANO,  # what requests in flight may still cost, on every gateway
            "left": max(0, round(limits.budget * NANO) - used - reserved) / NANO,
            "resets_at": current.resets_at.isoformat() if current.resets_at is not None else None,
        }

    async def exhausted(self, principal: Principal) -> None:
        """429 when the key's quota or its team's has nothing left in this window (a check that needs no
        request)."""
        now = self._clock()
        for counter in _counters(principal):  # token quotas: whether a request costs anything depends on its model
            current = window(counter.period, now)
            used, reserved = await self._store.quota_counts(counter.id, current.start)
            if used + reserved >= counter.limit:
                reservation = Reservation(counter.id, counter.limit, counter.period, current, 0, team=counter.team)
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
