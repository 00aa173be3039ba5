"""Admission: one service decides a request's fate before any of its input is touched.

The order, cheapest first, every check before any image is fetched or decoded, any file decoded or
extracted, or any prompt templated:

    the model exists → the key's requests per minute → the key's requests in flight
      → a quota reservation sized from what the request holds → the model's queue lease (a slot)

A key in a team passes each check twice, its own and then its team's (a team's rpm, requests in flight
and quota are counted under the team's id, for all its keys together, on every gateway).

Each refusal is immediate (429 with Retry-After, or 503/504 from the queue) and leaves nothing
behind. What was taken is held by the request's `Ticket` and given back, once, when it closes:
the slot, the place in flight, and the reservation, settled to what the request really used.
The slot is taken separately (`take_slot`), so that an async job is admitted when it is submitted
and waits for its slot in the background.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from llmserver import tracing
from llmserver.auth.keys import Principal, allowed, may_use
from llmserver.auth.limiters import ConcurrencyLimiter, RateLimiter
from llmserver.auth.quota import InsufficientQuota, QuotaService
from llmserver.errors import APIError, PermissionDenied, RateLimited, StateUnavailable
from llmserver.metrics.prometheus import Metrics
from llmserver.metrics.recorder import UNAVAILABLE, Tally, UsageRecorder
from llmserver.pool.router import Lease, Router

log = logging.getLogger(__name__)

SLOT_FREED_WAIT = 0.1  # the longest a request's end waits for its shared slot record to say it is free
T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    """What an admitted request holds until it closes; its tally is filled in as it runs."""

    tally: Tally
    lease: Lease
    admission: Admission = field(repr=False)
    places: ConcurrencyLimiter = field(repr=False)  # the limiter that counts its place in flight
    team_places: ConcurrencyLimiter | None = field(default=None, repr=False)  # its team's, when it has a limit
    # The bound of its prompt's tokens as admission counted it, with the messages it counted (the engine's:
    # read again, unchanged, while the slot is taken and the reservation resized).
    counted: tuple[object, int] | None = field(default=None, repr=False)
    # Why it must stop before its end (its key stopped standing: auth/revocation.py); a stream reads it at
    # each batch of events.
    ended: APIError | None = field(default=None, repr=False)
    model: str = field(init=False)  # its tally's (read often: an attribute, not a property)

    def __post_init__(self) -> None:
        self.model = self.tally.model

    def end(self, error: APIError) -> None:
        self.ended = error

    def close(self, outcome: str) -> None:
        """Give back the slot and the place in flight, settle the quota, record the request (once)."""
        self.admission.finish(self, outcome)

    async def shared(self) -> None:
        """Once closed, before the client hears the end: wait until its quota settlement is written
        and the other gateways have been told the slot is free (role `gateway`), so that a next turn
        sent at once to any of them sees the key's true balance and finds its conversation's
        instance free rather than one request busier — and, on a node's instance, its slot idle and its
        own (cluster/slots.py), so that the turn reuses its cached prompt."""
        if self.tally.settlements:
            await self.admission.settle(self)
        if (load_shared := self.lease.pool.load_shared) is not None:
            await load_shared()
        if self.lease.freeing is not None:  # a node's slot (cluster/slots.py): no coroutine made otherwise
            await self.lease.freed(SLOT_FREED_WAIT)


def _check_rate(principal: Principal, wait: float | None, team: bool = False) -> None:
    if wait is not None:
        if team:
            assert principal.team is not None
            who, rpm = f"This API key's team {principal.team.name!r} is", principal.team.limits.rpm
        else:
            who, rpm = "This API key is", principal.limits.rpm
        error = RateLimited(f"{who} limited to {rpm} requests per minute.", retry_after=max(1, math.ceil(wait)))
        error.reason = "rpm"
        raise error


def _too_many_in_flight(held: int, team: str | None = None) -> RateLimited:
    who = "This API key already has" if team is None else f"This API key's team {team!r} already has"
    error = RateLimited(
        f"{who} {held} {'request' if held == 1 else 'requests'} in flight, its limit. Retry when one has finished.",
        retry_after=1,
    )
    error.reason = "concurrency"
    return error


def outcome_of(exc: BaseException) -> str:
    """The ledger's outcome for a request that ended with this exception."""
    if isinstance(exc, StateUnavailable):
        return UNAVAILABLE  # not accepted: no ledger row unless it generated something
    if isinstance(exc, APIError):
        return exc.type
    # Cancelled: the client went away (or the server is shutting down under it).
    return "client_closed" if not isinstance(exc, Exception) else "server_error"


class Admission:
    def __init__(
        self,
        router: Router,
        rate: RateLimiter,
        concurrency: ConcurrencyLimiter,
        quota: QuotaService,
        recorder: UsageRecorder,
        metrics: Metrics,
        *,
        default_concurrency: int,
        local_concurrency: ConcurrencyLimiter | None = None,
    ) -> None:
        self._router = router
        self._rate = rate
        self._concurrency = concurrency
        # The default cap (default_concurrency) is a per-gateway guard, counted in this process even when
        # explicit limits are shared: a key without max_concurrency never waits on Redis.
        self._local = local_concurrency or concurrency
        self._quota = quota
        self._recorder = recorder
        self._metrics = metrics
        self._default_concurrency = default_concurrency

    async def precheck(self, principal: Principal) -> None:
        """Before a large body is even read: a key at its requests per minute or in flight, or with
        no quota left, is refused now, taking nothing (the body could only make the answer worse)."""
        key = principal.key_id
        try:
            if principal.limits.rpm is not None:
                _check_rate(principal, await self._rate.wait(key, principal.limits.rpm))
            held = await self._limiter(principal).held(key)
            if held >= self._places(principal):
                raise _too_many_in_flight(held)
            team = principal.team
            if team is not None:
                if team.limits.rpm is not None:
                    _check_rate(principal, await self._rate.wait(team.id, team.limits.rpm), team=True)
                if team.limits.max_concurrency is not None:
                    held = await self._concurrency.held(team.id)
                    if held >= team.limits.max_concurrency:
                        raise _too_many_in_flight(held, team.name)
            await self._settled(principal, lambda: self._quota.exhausted(principal))
        except APIError as exc:
            self._metrics.quota_rejections.labels(exc.type).inc()
            raise

    def routes_by_affinity(self, model: str) -> bool:
        """Whether `model`'s requests need an affinity key (ModelNotFound for a model that does not exist)."""
        return self._router.pool(model).chooses

    def _places(self, principal: Principal) -> int:
        return principal.limits.max_concurrency or self._default_concurrency

    def _limiter(self, principal: Principal) -> ConcurrencyLimiter:
        return self._concurrency if principal.limits.max_concurrency is not None else self._local

    async def _settled(self, principal: Principal, check: Callable[[], Awaitable[T]]) -> T:
        """A quota check; refused while one of the key's settlements is still queued (so its request's
        reservation still counts in full), it is asked again once that is written. Refusals are exact,
        and a request that fits does not wait for the previous one's write."""
        try:
            return await check()
        except InsufficientQuota:
            team = principal.team.id if principal.team is not None else ""
            if not self._recorder.settling(principal.key_id, team):
                raise
        await self._recorder.flush()
        return await check()

    async def admit(
        self,
        principal: Principal,
        endpoint: str,
        model: str,
        tokens: int,
        affinity: str | None = None,
        keep_alive: float | None = None,
        completion: int = 0,
    ) -> Ticket:
        """Every check but the slot, in order; a ticket holding the place in flight and the reservation.
        `affinity` is the request's prompt-cache key, for the slot's choice of instance; `completion`: how
        many of `tokens` are its max_tokens (priced as output by a budget, the rest as input)."""
        lease = self._router.lease(model, principal.key_id, affinity, keep_alive)
        team = principal.team
        if not allowed(principal, model):
            whose = "This API key's team" if may_use(principal.limits, model) else "This API key"
            raise PermissionDenied(f"{whose} may not use the model {model!r}.", param="model")
        key = principal.key_id
        # A span of its own (not the current one: nothing below makes spans), none when tracing is off.
        span = tracing.start("admission", {"model": model}) if tracing.on() else None
        try:
            if principal.limits.rpm is not None:
                _check_rate(principal, await self._rate.hit(key, principal.limits.rpm))
            if team is not None and team.limits.rpm is not None:
                _check_rate(principal, await self._rate.hit(team.id, team.limits.rpm), team=True)
            places = self._limiter(principal)
            refused = await places.acquire(key, self._places(principal))
            if refused is not None:
                raise _too_many_in_flight(refused)
            team_places = None
            try:
                if team is not None and team.limits.max_concurrency is not None:
                    refused = await self._concurrency.acquire(team.id, team.limits.max_concurrency)
                    if refused is not None:
                        raise _too_many_in_flight(refused, team.name)
                    team_places = self._concurrency
                prices = lease.pool.config.prices
                price = (prices.most_input, prices.output) if prices is not None else None
                reservations = await self._settled(
                    principal, lambda: self._quota.reserve(principal, tokens, price, completion)
                )
            except BaseException:
                places.release(key)
                if team_places is not None and team is not None:
                    team_places.release(team.id)
                raise
        except BaseException as exc:
            tracing.end(span, exc)
            if isinstance(exc, APIError):
                self._metrics.quota_rejections.labels(exc.type).inc()
            raise
        if span is not None:
            tracing.end(span)
        tally = Tally(principal, endpoint, model, reservations, prices=lease.pool.config.prices)
        self._recorder.opened(tally)
        return Ticket(tally, lease, self, places, team_places)

    async def take_slot(self, ticket: Ticket) -> None:
        """The model's queue lease: wait for a slot (503 when the queue is full, 504 past its timeout)."""
        started = time.perf_counter()
        try:
            if tracing.on():
                with tracing.span("queue", {"model": ticket.lease.pool.name}):
                    instance = await ticket.lease.acquire()
            else:  # without the no-op span's three calls
                instance = await ticket.lease.acquire()
        except BaseException as exc:
            ticket.close(outcome_of(exc))
            raise
        self._metrics.queue_wait.observe(ticket.lease.pool.name, time.perf_counter() - started)
        ticket.tally.instance_id = instance.id

    async def requeue(self, ticket: Ticket) -> None:
        """It gave its slot back to a key below its share (pool/pool.py): wait for one again, first among
        its key's requests and without the queue's timeout."""
        ticket.lease.release(finished=False)
        instance = await ticket.lease.acquire(resumed=True)
        ticket.tally.instance_id = instance.id

    async def resize(self, ticket: Ticket, tokens: int) -> None:
        """Hold `tokens` instead, now that the inputs are known (429 insufficient_quota if it grew
        past what is left): before anything reaches an instance."""
        try:
            await self._settled(ticket.tally.principal, lambda: self._quota.adjust(ticket.tally.reservations, tokens))
        except APIError as exc:
            self._metrics.quota_rejections.labels(exc.type).inc()
            raise

    async def settle(self, ticket: Ticket) -> None:
        await self._recorder.settle(ticket.tally)

    def finish(self, ticket: Ticket, outcome: str) -> None:
        tally = ticket.tally
        if tally.closed:
            return
        ticket.lease.release(finished=outcome == "ok")
        ticket.places.release(tally.principal.key_id)
        if ticket.team_places is not None and tally.principal.team is not None:
            ticket.team_places.release(tally.principal.team.id)
        self._recorder.close(tally, outcome)
