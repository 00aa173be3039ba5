"""The state the gateway keeps, as named interfaces: keys, quota counters, the usage ledger and speed
buckets, async jobs. Services depend on these protocols; the wiring (`open_store`) picks the engine.

Every method is a coroutine: an implementation may wait on a disk or a network, never on the
caller's event loop. Quota reservations, running jobs and claimed webhooks carry the id of the
gateway that owns them; each gateway holds a lease on its id (`GatewayStore`), and when a lease
lapses (the gateway died) another gateway sweeps what it owned: its reservations charged at what its
requests had produced, its running jobs failed. Never anyone else's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol


class SchemaError(Exception):
    """The database's schema is not the one this build uses; the message says what to run."""


@dataclass(frozen=True)
class KeyLimits:
    quota_tokens: int | None = None
    quota_period: str | None = None  # day | month | total
    rpm: int | None = None
    max_concurrency: int | None = None
    models: tuple[str, ...] | None = None  # the model names (or fnmatch patterns) it may use; None: all
    budget: float | None = None  # what its requests may cost per budget_period, in billing.currency
    budget_period: str | None = None  # day | month | total


NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    fingerprint: str
    is_admin: bool
    created_at: str
    revoked_at: str | None
    limits: KeyLimits = NO_LIMITS
    expires_at: float | None = None  # Unix seconds: refused from then on; None: never
    last_used_at: float | None = None  # as of the last batch a gateway wrote (every lease beat)
    previous_until: float | None = None  # the secret a rotation replaced is accepted until then
    team_id: str | None = None  # the team whose limits apply around its own; None: none
    team_admin: bool = False  # it manages its team's keys (and nothing else)

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True)
class TeamRecord:
    """Keys that share limits: each request of a member key must fit both the key's and the team's."""

    id: str
    name: str
    created_at: str
    limits: KeyLimits = NO_LIMITS


@dataclass(frozen=True)
class JobRecord:
    tracking_id: str
    key_id: str
    status: str  # pending | ready | failed | claimed (being handed to its one reader)
    nonce: str
    result: str | None
    error: str | None
    created_at: float
    expires_at: float | None


@dataclass(frozen=True)
class QuotaGrant:
    """The answer to a reservation: granted or not, and the window's counts as the store saw them."""

    granted: bool
    used: int
    reserved: int


@dataclass(frozen=True)
class Alert:
    """A mark on a counter whose crossing is reported (a budget's threshold): by the settlement that crosses
    it, once, whichever gateway writes it; with a webhook, queued in the outbox in the same transaction."""

    mark: int  # the counter's value
    url: str | None  # where `payload` is POSTed
    payload: str  # JSON
    owner: str  # key | team: the metric's label
    threshold: int  # percent: the metric's label


@dataclass(frozen=True)
class Settlement:
    """A finished request's quota: release `reserved` (held by `gateway_id`), charge `used`."""

    key_id: str
    period_start: str
    gateway_id: str
    reserved: int
    used: int
    alerts: tuple[Alert, ...] = ()  # marks whose crossing by this charge is reported (`record`'s answer)


def crossings(settlement: Settlement, after: int) -> list[Alert]:
    """The settlement's marks its charge crossed: its counter went from below each to at least it."""
    before = after - settlement.used
    return [alert for alert in settlement.alerts if before < alert.mark <= after]


def alert_id(settlement: Settlement, alert: Alert) -> str:
    """The outbox's name for a crossed mark (one per counter, window and mark)."""
    return f"budget:{settlement.key_id}:{settlement.period_start}:{alert.threshold}"


@dataclass
class UsageBatch:
    """What finished requests leave behind, written together: ledger rows, speed-bucket increments
    (model, minute, tokens, seconds) and quota settlements."""

    rows: list[dict[str, object]] = field(default_factory=list)
    speeds: list[tuple[str, int, float, float]] = field(default_factory=list)
    settlements: list[Settlement] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rows or self.speeds or self.settlements)

    def add_speed(self, increment: tuple[str, int, float, float]) -> None:
        """Queue a speed-bucket increment, added to the last one when it is for the same bucket (one
        model's requests in one minute: a busy gateway writes one row a batch, not one a request)."""
        model, minute, tokens, seconds = increment
        if self.speeds and self.speeds[-1][:2] == (model, minute):
            _, _, before_tokens, before_seconds = self.speeds[-1]
            self.speeds[-1] = (model, minute, before_tokens + tokens, before_seconds + seconds)
        else:
            self.speeds.append(increment)


# The ledger's outcomes a request log filters on: a request its client gave up on is no error of the server's.
STATUSES = ("ok", "error", "cancelled")


@dataclass(frozen=True)
class LedgerQuery:
    """A page of the usage ledger, newest first: rows in [since, until) of a key (None: all), a model and
    a status (`STATUSES`), those older than the row `before` (the previous page's last), `limit` of them.
    Ordered by time, which the ledger's indexes hold (by id, a page of a wide range sorted every row in
    it: 400 ms at a million rows on SQLite, against 0.1 ms)."""

    key_id: str | None = None
    model: str | None = None
    status: str | None = None
    since: float = 0.0
    until: float = float("inf")
    before: int | None = None
    limit: int = 50

    def where(self, mark: Callable[[object], str], before_time: float | None = None) -> str:
        """The SQL condition, each value placed by `mark` (which returns its placeholder). With `before`,
        the engine gives that row's time: rows older in a page's order (time, then id), that time made
        the upper bound an index on time seeks to."""
        terms = [f"time >= {mark(self.since)}"]
        if self.before is not None and before_time is not None and before_time < self.until:
            first, second, below = mark(before_time), mark(before_time), mark(self.before)
            terms.append(f"time <= {first} AND (time < {second} OR id < {below})")
        else:
            terms.append(f"time < {mark(self.until)}")
        if self.key_id is not None:
            terms.append(f"key_id = {mark(self.key_id)}")
        if self.model is not None:
            terms.append(f"model = {mark(self.model)}")
        if self.status == "ok":
            terms.append("outcome = 'ok'")
        elif self.status == "cancelled":
            terms.append("outcome = 'client_closed'")
        elif self.status == "error":
            terms.append("outcome NOT IN ('ok', 'client_closed')")
        return " AND ".join(terms)


AUDIT_COLUMNS = ("time", "key_id", "key_name", "action", "target", "change", "status", "client", "request_id")


@dataclass(frozen=True)
class AuditQuery:
    """A page of the audit log, newest first: rows in [since, until), of one admin key, one action and
    one target when given, older than the row `before` (the previous page's last), `limit` of them.
    Ordered by id, the order rows were appended in."""

    key_id: str | None = None
    action: str | None = None
    target: str | None = None
    since: float = 0.0
    until: float = float("inf")
    before: int | None = None
    limit: int = 50

    def where(self, mark: Callable[[object], str]) -> str:
        """The SQL condition, each value placed by `mark` (which returns its placeholder)."""
        terms = [f"time >= {mark(self.since)}", f"time < {mark(self.until)}"]
        for column, value in (("key_id", self.key_id), ("action", self.action), ("target", self.target)):
            if value is not None:
                terms.append(f"{column} = {mark(value)}")
        if self.before is not None:
            terms.append(f"id < {mark(self.before)}")
        return " AND ".join(terms)


def failure_webhook(tracking_id: str, error: str) -> str:
    """The webhook payload of a job a sweep failed (`error`: its stored error body, JSON), as the
    runner sends for any failed job."""
    return json.dumps({"status": "failed", "tracking_id": tracking_id, "error": json.loads(error).get("error")})


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class KeyStore(Protocol):
    async def insert_key(
        self,
        key_id: str,
        name: str,
        key_hash: str,
        fingerprint: str,
        is_admin: bool,
        limits: KeyLimits = NO_LIMITS,
        expires_at: float | None = None,
        team_id: str | None = None,
        team_admin: bool = False,
    ) -> KeyRecord: ...

    async def update_key_limits(self, key_id: str, limits: KeyLimits) -> bool: ...

    async def key_by_hash(self, key_hash: str) -> KeyRecord | None: ...

    async def key_by_previous_hash(self, key_hash: str, now: float) -> KeyRecord | None:
        """The active key whose secret before its last rotation this is, while its grace lasts (`now`)."""
        ...

    async def set_key_expiry(self, key_id: str, expires_at: float | None) -> bool: ...

    async def rotate_key(self, key_id: str, key_hash: str, fingerprint: str, previous_until: float) -> bool:
        """A new secret for an active key; the one it replaces is accepted until `previous_until` (a
        rotation within another's grace ends that one's)."""
        ...

    async def touch_keys(self, used: dict[str, float]) -> None:
        """Each key's last use (key id → Unix seconds), kept if later than the stored one."""
        ...

    async def key_by_id(self, key_id: str) -> KeyRecord | None: ...

    async def list_keys(self) -> list[KeyRecord]: ...

    async def revoke_key(self, key_id: str) -> bool:
        """Mark a key revoked; False when no active key has that id."""
        ...


class TeamStore(Protocol):
    async def insert_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | None:
        """None when another team has the name."""
        ...

    async def update_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | bool:
        """The team as changed; False for an unknown team, True when another team has the name."""
        ...

    async def team_by_id(self, team_id: str) -> TeamRecord | None: ...

    async def list_teams(self) -> list[TeamRecord]: ...

    async def delete_team(self, team_id: str) -> int | None:
        """Deleted when no active key is a member (0); else how many are (nothing changed). None: no
        such team."""
        ...

    async def set_key_team(self, key_id: str, team_id: str | None, team_admin: bool = False) -> bool:
        """Move an active key into a team (that exists), as one of its admins or not, or out of its team
        (None: and it is no team's admin)."""
        ...


class QuotaStore(Protocol):
    async def quota_reserve(
        self, key_id: str, period_start: str, gateway_id: str, amount: int, limit: int
    ) -> QuotaGrant:
        """Atomically add `amount` to this gateway's reservation if used + all reservations + amount ≤ limit."""
        ...

    async def quota_release(self, key_id: str, period_start: str, gateway_id: str, amount: int) -> None:
        """Give back part of this gateway's reservation (never below zero)."""
        ...

    async def quota_counts(self, key_id: str, period_start: str) -> tuple[int, int]:
        """(used, reserved by every gateway) in one window."""
        ...

    async def quota_progress(self, gateway_id: str, produced: dict[tuple[str, str], int]) -> None:
        """What this gateway's requests in flight have produced so far, per (key, window): what a sweep
        charges if the gateway dies. Windows not named have produced nothing."""
        ...


class UsageStore(Protocol):
    async def record(self, batch: UsageBatch) -> list[Alert]:
        """Ledger rows, speed increments and quota settlements, in one transaction."""
        ...

    async def usage_rows(self, key_id: str | None, since: float, until: float) -> list[dict[str, object]]: ...

    async def usage_page(self, query: LedgerQuery) -> list[dict[str, object]]:
        """Ledger rows matching `query`, newest first (by time, then id), at most `query.limit` of them;
        none when its `before` row is no longer there (removed by the ledger's retention)."""
        ...

    async def delete_usage_before(self, moment: float) -> int: ...

    async def speed_since(self, minute: int, prune: bool = True) -> list[tuple[str, int, int, float]]:
        """Speed buckets (model, minute, tokens, seconds) from `minute` on; older ones are deleted
        unless `prune` is False."""
        ...


class JobStore(Protocol):
    async def insert_job(
        self, tracking_id: str, key_id: str, nonce: str, now: float, gateway_id: str, webhook_url: str | None = None
    ) -> None: ...

    async def finish_job(
        self,
        tracking_id: str,
        *,
        result: str | None,
        error: str | None,
        now: float,
        expires_at: float,
        webhook: tuple[str, str] | None = None,
    ) -> None:
        """Store the job's outcome and, in the same transaction, queue its webhook (url, JSON payload)
        in the outbox."""
        ...

    async def job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        """The caller's own job, unless it expired; None for anyone else's."""
        ...

    async def claim_job(self, tracking_id: str, key_id: str, now: float, gateway_id: str) -> JobRecord | None:
        """Atomically take a finished job for one reader: a concurrent poll finds it claimed."""
        ...

    async def release_claim(self, tracking_id: str) -> None:
        """The claimed result did not reach its reader: make it pollable again."""
        ...

    async def delete_job(self, tracking_id: str) -> None: ...

    async def delete_expired_jobs(self, now: float) -> int: ...


@dataclass(frozen=True)
class OutboxItem:
    id: int
    tracking_id: str
    url: str
    payload: str
    attempts: int


class OutboxStore(Protocol):
    """Webhooks waiting to be sent: claimed by one gateway at a time, for `lease` seconds."""

    async def outbox_claim(self, gateway_id: str, lease: float, limit: int) -> list[OutboxItem]: ...

    async def outbox_retry(self, item_id: int, attempts: int, delay: float) -> None: ...

    async def outbox_done(self, item_id: int) -> None: ...

    async def outbox_depth(self) -> int:
        """Webhooks queued (not yet delivered or given up), every gateway's."""
        ...


@dataclass(frozen=True)
class GatewayHolder:
    """Who holds a gateway id's lease, and for how much longer (seconds; ≤ 0: lapsed)."""

    host: str
    pid: int
    seconds_left: float


@dataclass(frozen=True)
class Sweep:
    """What a sweep of a gateway's state did."""

    reservations: int
    charged: int
    jobs_failed: int


class GatewayStore(Protocol):
    """Leases on gateway ids, on the store's clock (gateways on several hosts may disagree on the time)."""

    async def gateway_holder(self, gateway_id: str) -> GatewayHolder | None: ...

    async def gateway_take(
        self, gateway_id: str, host: str, pid: int, lease: float, previous: GatewayHolder | None
    ) -> bool:
        """Hold the id for `lease` seconds, if its holder is still `previous` (None: nobody)."""
        ...

    async def gateway_renew(self, gateway_id: str, pid: int, lease: float) -> list[str] | None:
        """Extend this process's lease and name the gateways whose leases have lapsed (one round trip:
        a heartbeat's); None when this process no longer holds its lease (it was swept)."""
        ...

    async def gateway_release(self, gateway_id: str, pid: int) -> None: ...

    async def sweep_gateway(
        self, gateway_id: str, *, error: str, expires_at: float, only_if_lapsed: bool
    ) -> Sweep | None:
        """In one transaction: charge the gateway's quota reservations at what they had produced and
        drop them, fail its running jobs, make its undelivered claims pollable again, drop its lease.
        With `only_if_lapsed`, None (and nothing done) unless its lease has lapsed."""
        ...


@dataclass(frozen=True)
class CatalogEntry:
    """One model of the catalog: its settings (a ModelConfig's, as JSON), where they came from (`file`: a
    gateway's config file seeded them; `api`: the admin API or `llmserver models`), and a revision that
    counts its changes."""

    name: str
    config: str
    origin: str
    revision: int
    updated_at: float

    def settings(self) -> dict[str, object]:
        loaded: dict[str, object] = json.loads(self.config)
        return loaded


@dataclass(frozen=True)
class NodeMark:
    """An operator's mark on a worker node: `cordoned` (no new placements) or `draining` (no new
    placements, and its instances move to other nodes), since `since` (the store's clock)."""

    node: str
    state: str
    since: float


class CatalogStore(Protocol):
    """The model catalog, named leases (one holder at a time, on the store's clock), and the operator's
    marks on nodes."""

    async def catalog(self) -> list[CatalogEntry]: ...

    async def catalog_put(self, name: str, config: str, origin: str, *, create: bool | None) -> CatalogEntry | None:
        """Write a model's settings, its revision one more: `create` True inserts only (None if the name
        exists), False updates only (None if it does not), None either."""
        ...

    async def catalog_delete(self, name: str) -> bool: ...

    async def lease_take(self, name: str, holder: str, seconds: float) -> bool:
        """Hold the lease `name` for `seconds` if nobody does, its lease lapsed, or `holder` holds it."""
        ...

    async def lease_release(self, name: str, holder: str) -> None: ...

    async def node_marks(self) -> list[NodeMark]: ...

    async def node_mark(self, node: str, state: str | None) -> NodeMark | None:
        """Mark `node` (`cordoned`, `draining`), or lift its mark (None); the mark now in force."""
        ...


class AuditStore(Protocol):
    async def audit_append(self, row: dict[str, object]) -> None:
        """One admin action (`AUDIT_COLUMNS`): appended; rows are never changed, only swept by age."""
        ...

    async def audit_page(self, query: AuditQuery) -> list[dict[str, object]]: ...

    async def delete_audit_before(self, moment: float) -> int: ...


class Store(
    KeyStore, TeamStore, QuotaStore, UsageStore, JobStore, OutboxStore, GatewayStore, CatalogStore, AuditStore, Protocol
):
    """Everything at once: what `open_store` returns."""

    @property
    def schema_version(self) -> int: ...

    async def ping(self) -> None:
        """Answer a trivial query; StateUnavailable when the database cannot be reached."""
        ...

    async def close(self) -> None: ...
