"""Where every finished request is accounted: quota settlement, ledger row, speed, metrics.

The writes are batched: a request's close only queues them, and one task writes what is queued,
many requests per transaction under load, just after the responses went out (one commit inside each
request was 0.15 ms of its latency). Reads of the ledger `flush()` first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.auth.quota import QuotaService, Reservation
from llmserver.errors import StateUnavailable
from llmserver.logs import background
from llmserver.metrics.prometheus import Metrics
from llmserver.metrics.speed import RollingSpeed
from llmserver.outage import Outage
from llmserver.settings import Prices
from llmserver.store import Alert, Settlement, UsageBatch, UsageStore

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Tally:
    """One request's accounting, filled in as it goes."""

    principal: Principal
    endpoint: str
    model: str
    reservations: list[Reservation]  # on its key's quota and its team's (none without quotas)
    started: float = field(default_factory=time.perf_counter)
    instance_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, taken from the instance's prompt cache
    ttft: float | None = None
    last_token_at: float | None = None
    closed: bool = False
    settlements: list[Settlement] = field(default_factory=list)  # its quota settlements, until written
    span: Any = None  # its streamed instance call's trace span, ended when it closes (tracing.py)
    prices: Prices | None = None  # its model's, when it was admitted: the ledger row's cost


WRITE_DELAY = 0.2  # seconds
# The outcome of a request refused because the shared state could not be read (StateUnavailable) after
# it was admitted: counted as an overloaded_error, but not a ledger row — it was not accepted, like one
# refused when its key could not be looked up (unless it had generated tokens: those are charged).
UNAVAILABLE = "state_unavailable"


def cost_of(tally: Tally, charged: int) -> float | None:
    """A closed request's cost at its model's prices (None without prices; 0 when nothing was charged)."""
    if tally.prices is None:
        return None
    if not charged:
        return 0.0
    return tally.prices.cost(tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens)


class UsageRecorder:
    def __init__(self, store: UsageStore, quota: QuotaService, speed: RollingSpeed, metrics: Metrics) -> None:
        self._store = store
        self._quota = quota
        self._speed = speed
        self._metrics = metrics
        self._batch = UsageBatch()
        self._writing = UsageBatch()
        self._writer: asyncio.Task[None] | None = None
        self._open: set[Tally] = set()  # requests holding a quota reservation, until they close
        self._unwritten = Outage(log)  # down: the last write found the store unreachable
        self.on_alert: Callable[[], None] | None = None  # a budget threshold's webhook was queued (wakes the outbox)

    def settling(self, *counters: str) -> bool:
        """Whether a settlement of these quota counters (a key's, a team's) is queued or being written."""
        return any(s.key_id in counters for s in (*self._batch.settlements, *self._writing.settlements))

    async def flush(self) -> None:
        """Write everything queued so far (and wait for a write already under way); StateUnavailable
        while the store cannot be reached (what is queued stays queued)."""
        while self._writer is not None and not self._writer.done():
            if self._unwritten.down:
                raise StateUnavailable("The database cannot be reached; retry shortly.", retry_after=2)
            await asyncio.wait({self._writer}, timeout=0.5)
        if self._batch:
            self._schedule_write()
            await self.flush()

    def _schedule_write(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = background(self._write(), name="usage-writer")

    async def _write(self) -> None:
        # Waits a moment first: requests that end meanwhile join the batch, so that a busy gateway
        # writes (a thread hop and a transaction) a few times a second, not once per request.
        # flush() waits for it; nothing reads the ledger without flushing first.
        await asyncio.sleep(WRITE_DELAY)
        delay = 1.0
        while self._batch:
            self._writing, self._batch = self._batch, UsageBatch()
            batch = self._writing
            try:
                self._crossed(await self._store.record(batch))
            except StateUnavailable:
                # Kept, in order, and written once the store answers again: nothing accepted is lost.
                self._batch = UsageBatch(
                    batch.rows + self._batch.rows,
                    batch.speeds + self._batch.speeds,
                    batch.settlements + self._batch.settlements,
                )
                self._writing = UsageBatch()
                self._unwritten.failed(
                    "usage rows and quota settlements wait for the database to answer again", level=logging.WARNING
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            except Exception:
                log.exception(
                    "could not write %d usage rows and %d settlements", len(batch.rows), len(batch.settlements)
                )
            self._unwritten.recovered("usage rows and quota settlements are written again")
            self._writing = UsageBatch()

    async def settle(self, tally: Tally) -> None:
        """Write a closed request's quota settlement now, before its client hears the end: the next
        request of the key, through any gateway sharing the store, then sees the true balance rather
        than this one's whole reservation. While the store cannot be reached it stays queued (written
        when it answers again) and the answer is not held back."""
        settlements, tally.settlements = tally.settlements, []
        if not settlements or self._unwritten.down:
            return
        if any(s in self._writing.settlements for s in settlements) and self._writer is not None:
            await asyncio.wait({self._writer}, timeout=1.0)  # being written with a batch
            return
        queued = [s for s in settlements if s in self._batch.settlements]
        if not queued:
            return
        for settlement in queued:
            self._batch.settlements.remove(settlement)
        try:
            self._crossed(await self._store.record(UsageBatch(settlements=queued)))
        except Exception:
            self._batch.settlements[:0] = queued  # the writer keeps trying (and logs why)
            self._schedule_write()

    def _crossed(self, alerts: list[Alert]) -> None:
        """Budget thresholds the settlements just written crossed (each once, whichever gateway wrote it)."""
        for alert in alerts:
            self._metrics.budget_alerts.labels(alert.owner, str(alert.threshold)).inc()
            log.warning("budget threshold crossed: %s", alert.payload)
        if alerts and self.on_alert is not None and any(alert.url for alert in alerts):
            self.on_alert()

    def opened(self, tally: Tally) -> None:
        """A request that holds a quota reservation started: counted in `produced()` until it closes."""
        if tally.reservations:
            self._open.add(tally)

    def produced(self) -> dict[tuple[str, str], int]:
        """Tokens this gateway's requests have produced that its quota windows have not been charged yet,
        per (key, window): those in flight (so far) and those settled but not yet written."""
        produced: dict[tuple[str, str], int] = {}
        for tally in self._open:
            for reservation in tally.reservations:
                if not reservation.settled:
                    where = (reservation.key_id, reservation.window.start)
                    tokens = reservation.units(tally.prompt_tokens + tally.completion_tokens)
                    produced[where] = produced.get(where, 0) + min(reservation.amount, tokens)
        for settlement in (*self._writing.settlements, *self._batch.settlements):
            if settlement.used:
                where = (settlement.key_id, settlement.period_start)
                produced[where] = produced.get(where, 0) + settlement.used
        return {where: tokens for where, tokens in produced.items() if tokens}

    def token(self, tally: Tally) -> None:
        """A streamed token went out: counted (one per event; the final usage corrects it), its time
        to first token, then the gaps."""
        tally.completion_tokens += 1
        now = time.perf_counter()
        if tally.ttft is None:
            tally.ttft = now - tally.started
            self._metrics.ttft.observe(tally.model, tally.ttft)
        elif tally.last_token_at is not None:
            self._metrics.inter_token.observe(tally.model, now - tally.last_token_at)
        tally.last_token_at = now

    def close(self, tally: Tally, outcome: str) -> None:
        """Settle the quota to what was generated (all of it released if nothing was) and record it."""
        if tally.closed:
            return
        tally.closed = True
        self._open.discard(tally)
        if tally.span is not None:
            tally.span.set_attribute("outcome", outcome)
            tally.span.end()
        latency = time.perf_counter() - tally.started
        charged = tally.prompt_tokens + tally.completion_tokens if tally.completion_tokens or outcome == "ok" else 0
        cost = cost_of(tally, charged)
        settlements = self._quota.settlements(tally.reservations, charged, cost)
        if settlements:
            self._batch.settlements.extend(settlements)
            tally.settlements = settlements
        # Refused for unreachable shared state: not accepted, no row (unless it generated: charged, recorded).
        row = charged or outcome != UNAVAILABLE
        if outcome == UNAVAILABLE:
            outcome = StateUnavailable.type
        speed = tally.completion_tokens / latency if latency > 0 and tally.completion_tokens else None
        if row:
            self._batch.rows.append(self._row(tally, outcome, charged, latency, speed, cost))
        if charged:
            self._metrics.requests.add(
                tally.endpoint, tally.model, outcome, tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens
            )
        else:
            self._metrics.requests.add(tally.endpoint, tally.model, outcome)
        if outcome == "ok":
            increment = self._speed.add(tally.model, tally.completion_tokens, latency)
            if increment is not None:
                self._batch.add_speed(increment)
        self._schedule_write()

    @staticmethod
    def _row(
        tally: Tally, outcome: str, charged: int, latency: float, speed: float | None, cost: float | None
    ) -> dict[str, object]:
        return {
            "time": time.time(),
            "key_id": tally.principal.key_id,
            "model": tally.model,
            "instance_id": tally.instance_id,
            "endpoint": tally.endpoint,
            "prompt_tokens": tally.prompt_tokens if charged else 0,
            "completion_tokens": tally.completion_tokens,
            "latency_ms": round(latency * 1000, 1),
            "ttft_ms": round(tally.ttft * 1000, 1) if tally.ttft is not None else None,
            "tokens_per_second": round(speed, 2) if speed else None,
            "outcome": outcome,
            "cost": cost,
        }

    def refused(self, principal: Principal, endpoint: str, model: str, outcome: str) -> None:
        """A ledger row for a request refused before it was admitted (its body, its limits)."""
        self._batch.rows.append(
            {
                "time": time.time(), "key_id": principal.key_id, "model": model, "instance_id": None,
                "endpoint": endpoint, "prompt_tokens": 0, "completion_tokens": 0, "latency_ms": 0.0,
                "ttft_ms": None, "tokens_per_second": None, "outcome": outcome,
            }
        )  # fmt: skip
        self._metrics.requests.add(endpoint, model, outcome)
        self._schedule_write()

    def first_token(self, tally: Tally, seconds: float) -> None:
        """A non-streamed answer's time to first token, as llama-server measured it."""
        tally.ttft = seconds
        self._metrics.ttft.observe(tally.model, seconds)
