"""The PostgreSQL store: the truth that many gateways share (asyncpg, one connection pool per process).

Quota counters are exact across gateways: a reservation locks its key's counter row (`FOR UPDATE`)
for the check and the write, one transaction each; a batch of settlements takes the counter locks in
one order (sorted), so that two gateways' batches never deadlock. Leases use the database's clock.
When the server cannot be reached, every call raises `StateUnavailable` (503 with Retry-After); the
pool reconnects by itself once it is back. The outage is logged once, and so is its end.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from llmserver.errors import StateUnavailable
from llmserver.outage import Outage
from llmserver.store.interfaces import (
    AUDIT_COLUMNS,
    NO_LIMITS,
    Alert,
    AuditQuery,
    CatalogEntry,
    GatewayHolder,
    JobRecord,
    KeyLimits,
    KeyRecord,
    LedgerQuery,
    NodeMark,
    OutboxItem,
    QuotaGrant,
    SchemaError,
    Sweep,
    TeamRecord,
    UsageBatch,
    alert_id,
    crossings,
    failure_webhook,
    utc_now,
)
from llmserver.store.migrations import POSTGRES
from llmserver.store.rows import (
    LIMIT_COLUMNS,
    job_record,
    key_record,
    limit_marks,
    limit_sets,
    limit_values,
    redact,
    team_record,
)

log = logging.getLogger(__name__)

NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
UNREACHABLE = (
    OSError,
    # A connection left mid-operation when the server went away ("cannot switch to state …; another
    # operation is in progress"): the server is what failed, and the connection is dropped.
    asyncpg.InternalClientError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
)
MIGRATE_LOCK = 0x6C6C6D73  # pg_advisory_xact_lock's id for migrations: 'llms'


class PostgresStore:
    def __init__(self, url: str, pool: asyncpg.Pool, version: int) -> None:
        self.url = url
        self._pool = pool
        self._version = version
        self._outage = Outage(log)

    @classmethod
    async def connect(cls, url: str, *, migrate: bool = False, pool_size: int = 10) -> PostgresStore:
        """A pool on the database; SchemaError unless its schema is this build's (after migrating, with
        `migrate`), StateUnavailable when the server cannot be reached."""
        try:
            # min_size 0: asyncpg keeps no floor to restore (and log a traceback for) while the server is down.
            pool = await asyncpg.create_pool(url, min_size=0, max_size=pool_size, timeout=10, command_timeout=30)
        except UNREACHABLE as exc:
            raise StateUnavailable(f"PostgreSQL at {redact(url)} cannot be reached: {exc}") from exc
        assert pool is not None
        try:
            async with pool.acquire() as conn:
                version = await _migrate(conn) if migrate else await _version(conn)
        except UNREACHABLE as exc:
            await pool.close()
            raise StateUnavailable(f"PostgreSQL at {redact(url)} cannot be reached: {exc}") from exc
        except BaseException:
            await pool.close()
            raise
        if version != len(POSTGRES):
            await pool.close()
            if version > len(POSTGRES):
                raise SchemaError(
                    f"the database {redact(url)} has schema version {version}, newer than this llmserver knows "
                    f"({len(POSTGRES)}): run a newer llmserver on it"
                )
            raise SchemaError(
                f"the database {redact(url)} has schema version {version} and this llmserver needs "
                f"{len(POSTGRES)}: run `llmserver db migrate --database-url URL` first"
            )
        return cls(url, pool, version)

    async def close(self) -> None:
        await self._pool.close()

    async def ping(self) -> None:
        """A query that answers (the readiness probe's); StateUnavailable when the server does not."""
        async with self._conn() as conn:
            await conn.fetchval("SELECT 1", timeout=2)

    @property
    def schema_version(self) -> int:
        return self._version

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            async with self._pool.acquire(timeout=10) as conn:
                try:
                    yield conn
                except asyncpg.InternalClientError:
                    conn.terminate()  # its protocol state is broken: never handed out again
                    raise
        except UNREACHABLE as exc:
            self._outage.failed("PostgreSQL at %s cannot be reached (%s): answering 503", redact(self.url), exc)
            raise StateUnavailable("The database cannot be reached; retry shortly.", retry_after=2) from exc
        self._outage.recovered("PostgreSQL at %s answers again", redact(self.url))

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._conn() as conn, conn.transaction():
            yield conn

    async def _execute(self, query: str, *args: Any) -> str:
        async with self._conn() as conn:
            return str(await conn.execute(query, *args))

    async def _executemany(self, query: str, args: list[tuple[Any, ...]]) -> None:
        async with self._conn() as conn:
            await conn.executemany(query, args)

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self._conn() as conn:
            return list(await conn.fetch(query, *args))

    async def _fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        async with self._conn() as conn:
            return await conn.fetchrow(query, *args)

    # API keys

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
    ) -> KeyRecord:
        created = utc_now()
        team_admin = team_admin and team_id is not None
        await self._execute(
            f"INSERT INTO api_keys (id, name, key_hash, fingerprint, is_admin, created_at, {', '.join(LIMIT_COLUMNS)},"
            f" expires_at, team_id, is_team_admin) VALUES ($1, $2, $3, $4, $5, $6, {limit_marks(7)}, $14, $15, $16)",
            key_id, name, key_hash, fingerprint, is_admin, created, *limit_values(limits), expires_at, team_id,
            team_admin,
        )  # fmt: skip
        return KeyRecord(
            key_id,
            name,
            fingerprint,
            is_admin,
            created,
            None,
            limits,
            expires_at,
            team_id=team_id,
            team_admin=team_admin,
        )

    async def update_key_limits(self, key_id: str, limits: KeyLimits) -> bool:
        status = await self._execute(
            f"UPDATE api_keys SET {limit_sets(1)} WHERE id = $8",
            *limit_values(limits), key_id,
        )  # fmt: skip
        return status == "UPDATE 1"

    async def key_by_hash(self, key_hash: str) -> KeyRecord | None:
        row = await self._fetchrow("SELECT * FROM api_keys WHERE key_hash = $1", key_hash)
        return key_record(row) if row is not None else None

    async def key_by_previous_hash(self, key_hash: str, now: float) -> KeyRecord | None:
        row = await self._fetchrow(
            "SELECT * FROM api_keys WHERE previous_hash = $1 AND previous_until > $2 AND revoked_at IS NULL",
            key_hash, now,
        )  # fmt: skip
        return key_record(row) if row is not None else None

    async def set_key_expiry(self, key_id: str, expires_at: float | None) -> bool:
        status = await self._execute("UPDATE api_keys SET expires_at = $1 WHERE id = $2", expires_at, key_id)
        return status == "UPDATE 1"

    async def rotate_key(self, key_id: str, key_hash: str, fingerprint: str, previous_until: float) -> bool:
        status = await self._execute(
            "UPDATE api_keys SET previous_hash = key_hash, previous_until = $1, key_hash = $2, fingerprint = $3"
            " WHERE id = $4 AND revoked_at IS NULL",
            previous_until, key_hash, fingerprint, key_id,
        )  # fmt: skip
        return status == "UPDATE 1"

    async def touch_keys(self, used: dict[str, float]) -> None:
        await self._executemany(
            "UPDATE api_keys SET last_used_at = GREATEST(COALESCE(last_used_at, 0), $1) WHERE id = $2",
            [(when, key_id) for key_id, when in used.items()],
        )

    async def key_by_id(self, key_id: str) -> KeyRecord | None:
        row = await self._fetchrow("SELECT * FROM api_keys WHERE id = $1", key_id)
        return key_record(row) if row is not None else None

    async def list_keys(self) -> list[KeyRecord]:
        return [key_record(row) for row in await self._fetch("SELECT * FROM api_keys ORDER BY created_at, id")]

    async def revoke_key(self, key_id: str) -> bool:
        status = await self._execute(
            "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL", utc_now(), key_id
        )
        return status == "UPDATE 1"

    # Teams

    async def insert_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | None:
        created = utc_now()
        status = await self._execute(
            f"INSERT INTO teams (id, name, created_at, {', '.join(LIMIT_COLUMNS)})"
            f" VALUES ($1, $2, $3, {limit_marks(4)}) ON CONFLICT (name) DO NOTHING",
            team_id, name, created, *limit_values(limits),
        )  # fmt: skip
        return TeamRecord(team_id, name, created, limits) if status == "INSERT 0 1" else None

    async def update_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | bool:
        try:
            row = await self._fetchrow(
                f"UPDATE teams SET name = $1, {limit_sets(2)} WHERE id = $9 RETURNING *",
                name, *limit_values(limits), team_id,
            )  # fmt: skip
        except asyncpg.UniqueViolationError:
            return True
        return team_record(row) if row is not None else False

    async def team_by_id(self, team_id: str) -> TeamRecord | None:
        row = await self._fetchrow("SELECT * FROM teams WHERE id = $1", team_id)
        return team_record(row) if row is not None else None

    async def list_teams(self) -> list[TeamRecord]:
        return [team_record(row) for row in await self._fetch("SELECT * FROM teams ORDER BY name")]

    async def delete_team(self, team_id: str) -> int | None:
        async with self._transaction() as conn:
            # The team's row locked first, as a key moved into it locks it (set_key_team): no key joins
            # a team being deleted.
            if await conn.fetchval("SELECT 1 FROM teams WHERE id = $1 FOR UPDATE", team_id) is None:
                return None
            members = await conn.fetchval(
                "SELECT COUNT(*) FROM api_keys WHERE team_id = $1 AND revoked_at IS NULL", team_id
            )
            if not members:
                await conn.execute("DELETE FROM teams WHERE id = $1", team_id)
        return int(members)

    async def set_key_team(self, key_id: str, team_id: str | None, team_admin: bool = False) -> bool:
        async with self._transaction() as conn:
            if (
                team_id is not None
                and await conn.fetchval("SELECT 1 FROM teams WHERE id = $1 FOR SHARE", team_id) is None
            ):
                return False
            status = await conn.execute(
                "UPDATE api_keys SET team_id = $1, is_team_admin = $2 WHERE id = $3 AND revoked_at IS NULL",
                team_id, team_admin and team_id is not None, key_id,
            )  # fmt: skip
        return str(status) == "UPDATE 1"

    # Quota counters (a key's or a team's)

    @staticmethod
    async def _lock_counter(conn: asyncpg.Connection, key_id: str, period_start: str) -> int:
        """Lock the (key, window) counter row, made if missing; what it has used."""
        await conn.execute(
            "INSERT INTO quota_usage (key_id, period_start, used) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING",
            key_id,
            period_start,
        )
        used = await conn.fetchval(
            "SELECT used FROM quota_usage WHERE key_id = $1 AND period_start = $2 FOR UPDATE", key_id, period_start
        )
        return int(used)

    @staticmethod
    async def _reserved(conn: asyncpg.Connection, key_id: str, period_start: str) -> int:
        reserved = await conn.fetchval(
            "SELECT COALESCE(SUM(amount), 0) FROM quota_reservations WHERE key_id = $1 AND period_start = $2",
            key_id,
            period_start,
        )
        return int(reserved)

    async def quota_reserve(
        self, key_id: str, period_start: str, gateway_id: str, amount: int, limit: int
    ) -> QuotaGrant:
        async with self._transaction() as conn:
            used = await self._lock_counter(conn, key_id, period_start)
            reserved = await self._reserved(conn, key_id, period_start)
            if used + reserved + amount > limit:
                return QuotaGrant(False, used, reserved)
            await conn.execute(
                "INSERT INTO quota_reservations (key_id, period_start, gateway_id, amount) VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (key_id, period_start, gateway_id)"
                " DO UPDATE SET amount = quota_reservations.amount + excluded.amount",
                key_id, period_start, gateway_id, amount,
            )  # fmt: skip
        return QuotaGrant(True, used, reserved + amount)

    async def quota_release(self, key_id: str, period_start: str, gateway_id: str, amount: int) -> None:
        await self._execute(
            "UPDATE quota_reservations SET amount = GREATEST(0, amount - $1)"
            " WHERE key_id = $2 AND period_start = $3 AND gateway_id = $4",
            amount, key_id, period_start, gateway_id,
        )  # fmt: skip

    async def quota_counts(self, key_id: str, period_start: str) -> tuple[int, int]:
        row = await self._fetchrow(
            "SELECT (SELECT used FROM quota_usage WHERE key_id = $1 AND period_start = $2),"
            " (SELECT COALESCE(SUM(amount), 0) FROM quota_reservations WHERE key_id = $1 AND period_start = $2)",
            key_id,
            period_start,
        )
        assert row is not None
        return int(row[0] or 0), int(row[1])

    async def quota_progress(self, gateway_id: str, produced: dict[tuple[str, str], int]) -> None:
        async with self._transaction() as conn:
            await conn.execute(
                "UPDATE quota_reservations SET produced = 0 WHERE gateway_id = $1 AND produced <> 0", gateway_id
            )
            await conn.executemany(
                "UPDATE quota_reservations SET produced = $1"
                " WHERE key_id = $2 AND period_start = $3 AND gateway_id = $4",
                [(tokens, key_id, period, gateway_id) for (key_id, period), tokens in sorted(produced.items())],
            )

    # The usage ledger and the speed buckets

    async def record(self, batch: UsageBatch) -> list[Alert]:
        crossed: list[Alert] = []
        async with self._transaction() as conn:
            for s in sorted(batch.settlements, key=lambda s: (s.key_id, s.period_start, s.gateway_id)):
                # The counter's lock first (as a reservation takes it), then the reservation.
                await self._lock_counter(conn, s.key_id, s.period_start)
                if s.used:
                    after = await conn.fetchval(
                        "UPDATE quota_usage SET used = used + $1 WHERE key_id = $2 AND period_start = $3"
                        " RETURNING used",
                        s.used, s.key_id, s.period_start,
                    )  # fmt: skip
                    for alert in crossings(s, int(after)):
                        crossed.append(alert)
                        if alert.url is not None:
                            await conn.execute(
                                "INSERT INTO webhook_outbox (tracking_id, url, payload, next_at)"
                                f" VALUES ($1, $2, $3, {NOW})",
                                alert_id(s, alert), alert.url, alert.payload,
                            )  # fmt: skip
                await conn.execute(
                    "UPDATE quota_reservations SET amount = GREATEST(0, amount - $1)"
                    " WHERE key_id = $2 AND period_start = $3 AND gateway_id = $4",
                    s.reserved, s.key_id, s.period_start, s.gateway_id,
                )  # fmt: skip
            if batch.rows:
                await conn.copy_records_to_table(
                    "usage_ledger",
                    columns=LEDGER_COLUMNS,
                    records=[tuple(row.get(column) for column in LEDGER_COLUMNS) for row in batch.rows],
                )
            await conn.executemany(
                "INSERT INTO speed_buckets (model, minute, tokens, seconds) VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (model, minute) DO UPDATE SET tokens = speed_buckets.tokens + excluded.tokens,"
                " seconds = speed_buckets.seconds + excluded.seconds",
                [(model, minute, int(tokens), seconds) for model, minute, tokens, seconds in sorted(batch.speeds)],
            )
        return crossed

    async def usage_rows(self, key_id: str | None, since: float, until: float) -> list[dict[str, object]]:
        query = "SELECT * FROM usage_ledger WHERE time >= $1 AND time < $2"
        params: list[object] = [since, until]
        if key_id is not None:
            query += " AND key_id = $3"
            params.append(key_id)
        return [dict(row) for row in await self._fetch(query + " ORDER BY time, id", *params)]

    async def usage_page(self, query: LedgerQuery) -> list[dict[str, object]]:
        params: list[object] = []

        def mark(value: object) -> str:
            params.append(value)
            return f"${len(params)}"

        before_time = None
        if query.before is not None:
            found = await self._fetchrow("SELECT time FROM usage_ledger WHERE id = $1", query.before)
            if found is None:
                return []
            before_time = float(found["time"])
        where = query.where(mark, before_time)
        sql = f"SELECT * FROM usage_ledger WHERE {where} ORDER BY time DESC, id DESC LIMIT ${len(params) + 1}"
        return [dict(row) for row in await self._fetch(sql, *params, query.limit)]

    async def delete_usage_before(self, moment: float) -> int:
        return _count(await self._execute("DELETE FROM usage_ledger WHERE time < $1", moment))

    # The audit log

    async def audit_append(self, row: dict[str, object]) -> None:
        marks = ", ".join(f"${n}" for n in range(1, len(AUDIT_COLUMNS) + 1))
        await self._execute(
            f"INSERT INTO audit_log ({', '.join(AUDIT_COLUMNS)}) VALUES ({marks})",
            *(row.get(column) for column in AUDIT_COLUMNS),
        )

    async def audit_page(self, query: AuditQuery) -> list[dict[str, object]]:
        params: list[object] = []

        def mark(value: object) -> str:
            params.append(value)
            return f"${len(params)}"

        where = query.where(mark)
        sql = f"SELECT * FROM audit_log WHERE {where} ORDER BY id DESC LIMIT ${len(params) + 1}"
        return [dict(row) for row in await self._fetch(sql, *params, query.limit)]

    async def delete_audit_before(self, moment: float) -> int:
        return _count(await self._execute("DELETE FROM audit_log WHERE time < $1", moment))

    async def speed_since(self, minute: int, prune: bool = True) -> list[tuple[str, int, int, float]]:
        rows = await self._fetch("SELECT model, minute, tokens, seconds FROM speed_buckets WHERE minute >= $1", minute)
        if prune:
            await self._execute("DELETE FROM speed_buckets WHERE minute < $1", minute)
        return [(r["model"], int(r["minute"]), int(r["tokens"]), float(r["seconds"])) for r in rows]

    # Async jobs

    async def insert_job(
        self, tracking_id: str, key_id: str, nonce: str, now: float, gateway_id: str, webhook_url: str | None = None
    ) -> None:
        await self._execute(
            "INSERT INTO jobs (tracking_id, key_id, status, nonce, created_at, gateway_id, webhook_url)"
            " VALUES ($1, $2, 'pending', $3, $4, $5, $6)",
            tracking_id, key_id, nonce, now, gateway_id, webhook_url,
        )  # fmt: skip

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
        async with self._transaction() as conn:
            status = await conn.execute(
                "UPDATE jobs SET status = $1, result = $2, error = $3, finished_at = $4, expires_at = $5"
                " WHERE tracking_id = $6 AND status = 'pending'",
                "ready" if result is not None else "failed", result, error, now, expires_at, tracking_id,
            )  # fmt: skip
            if webhook is not None and status == "UPDATE 1":
                await conn.execute(
                    "INSERT INTO webhook_outbox (tracking_id, url, payload, next_at) VALUES ($1, $2, $3, $4)",
                    tracking_id, *webhook, now,
                )  # fmt: skip

    async def job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        row = await self._fetchrow(
            "SELECT * FROM jobs WHERE tracking_id = $1 AND key_id = $2 AND (expires_at IS NULL OR expires_at > $3)",
            tracking_id, key_id, now,
        )  # fmt: skip
        return job_record(row) if row is not None else None

    async def claim_job(self, tracking_id: str, key_id: str, now: float, gateway_id: str) -> JobRecord | None:
        # One UPDATE: a concurrent claim on another gateway waits for the row's lock, then finds it claimed.
        row = await self._fetchrow(
            "UPDATE jobs SET status = 'claimed', claimed_by = $1 WHERE tracking_id = $2 AND key_id = $3"
            " AND status IN ('ready', 'failed') AND expires_at > $4 RETURNING *",
            gateway_id, tracking_id, key_id, now,
        )  # fmt: skip
        return job_record(row) if row is not None else None

    async def release_claim(self, tracking_id: str) -> None:
        await self._execute(
            "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END, claimed_by = NULL"
            " WHERE tracking_id = $1 AND status = 'claimed'",
            tracking_id,
        )

    async def delete_job(self, tracking_id: str) -> None:
        await self._execute("DELETE FROM jobs WHERE tracking_id = $1", tracking_id)

    async def delete_expired_jobs(self, now: float) -> int:
        return _count(await self._execute("DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= $1", now))

    # The webhook outbox

    async def outbox_claim(self, gateway_id: str, lease: float, limit: int) -> list[OutboxItem]:
        rows = await self._fetch(
            f"UPDATE webhook_outbox SET claimed_by = $1, claimed_until = {NOW} + $2 WHERE id IN"
            f" (SELECT id FROM webhook_outbox WHERE next_at <= {NOW}"
            f" AND (claimed_until IS NULL OR claimed_until < {NOW})"
            " ORDER BY next_at LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING id, tracking_id, url, payload, attempts",
            gateway_id, lease, limit,
        )  # fmt: skip
        return [OutboxItem(r["id"], r["tracking_id"], r["url"], r["payload"], r["attempts"]) for r in rows]

    async def outbox_retry(self, item_id: int, attempts: int, delay: float) -> None:
        await self._execute(
            f"UPDATE webhook_outbox SET attempts = $1, next_at = {NOW} + $2, claimed_by = NULL, claimed_until = NULL"
            " WHERE id = $3",
            attempts, delay, item_id,
        )  # fmt: skip

    async def outbox_done(self, item_id: int) -> None:
        await self._execute("DELETE FROM webhook_outbox WHERE id = $1", item_id)

    async def outbox_depth(self) -> int:
        async with self._conn() as conn:
            return int(await conn.fetchval("SELECT COUNT(*) FROM webhook_outbox", timeout=2))

    # Gateway leases, and the sweep of a gateway's state

    async def gateway_holder(self, gateway_id: str) -> GatewayHolder | None:
        row = await self._fetchrow(
            f"SELECT host, pid, lease_until - {NOW} AS left FROM gateways WHERE id = $1", gateway_id
        )
        return GatewayHolder(row["host"], row["pid"], float(row["left"])) if row is not None else None

    async def gateway_take(
        self, gateway_id: str, host: str, pid: int, lease: float, previous: GatewayHolder | None
    ) -> bool:
        async with self._transaction() as conn:
            row = await conn.fetchrow("SELECT host, pid FROM gateways WHERE id = $1 FOR UPDATE", gateway_id)
            if previous is None:
                if row is not None:
                    return False
            elif row is None or (row["host"], row["pid"]) != (previous.host, previous.pid):
                return False
            await conn.execute(
                f"INSERT INTO gateways (id, host, pid, started_at, lease_until) VALUES ($1, $2, $3, {NOW}, {NOW} + $4)"
                " ON CONFLICT (id) DO UPDATE SET host = excluded.host, pid = excluded.pid,"
                " started_at = excluded.started_at, lease_until = excluded.lease_until",
                gateway_id, host, pid, lease,
            )  # fmt: skip
        return True

    async def gateway_renew(self, gateway_id: str, pid: int, lease: float) -> list[str] | None:
        # One statement: the lapsed are read from the snapshot before the update (this gateway's own row
        # may be among them; the caller skips itself).
        row = await self._fetchrow(
            f"WITH renewed AS (UPDATE gateways SET lease_until = {NOW} + $1 WHERE id = $2 AND pid = $3 RETURNING id)"
            f" SELECT (SELECT count(*) FROM renewed) AS renewed,"
            f" ARRAY(SELECT id FROM gateways WHERE lease_until < {NOW} ORDER BY id) AS lapsed",
            lease, gateway_id, pid,
        )  # fmt: skip
        assert row is not None
        return list(row["lapsed"]) if row["renewed"] == 1 else None

    async def gateway_release(self, gateway_id: str, pid: int) -> None:
        await self._execute("DELETE FROM gateways WHERE id = $1 AND pid = $2", gateway_id, pid)

    async def sweep_gateway(
        self, gateway_id: str, *, error: str, expires_at: float, only_if_lapsed: bool
    ) -> Sweep | None:
        async with self._transaction() as conn:
            if only_if_lapsed:
                swept = await conn.fetchval(
                    f"DELETE FROM gateways WHERE id = $1 AND lease_until < {NOW} RETURNING id", gateway_id
                )
                if swept is None:
                    return None
            held = await conn.fetch(
                "SELECT key_id, period_start, amount, produced FROM quota_reservations WHERE gateway_id = $1"
                " ORDER BY key_id, period_start",
                gateway_id,
            )
            charged = 0
            for row in held:
                await self._lock_counter(conn, row["key_id"], row["period_start"])
                charge = min(int(row["amount"]), int(row["produced"]))
                charged += charge
                if charge:
                    await conn.execute(
                        "UPDATE quota_usage SET used = used + $1 WHERE key_id = $2 AND period_start = $3",
                        charge, row["key_id"], row["period_start"],
                    )  # fmt: skip
            await conn.execute("DELETE FROM quota_reservations WHERE gateway_id = $1", gateway_id)
            await conn.execute(
                "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END, claimed_by = NULL"
                " WHERE status = 'claimed' AND claimed_by = $1",
                gateway_id,
            )
            hooked = await conn.fetch(
                "SELECT tracking_id, webhook_url FROM jobs"
                " WHERE status = 'pending' AND gateway_id = $1 AND webhook_url IS NOT NULL",
                gateway_id,
            )
            failed = _count(
                await conn.execute(
                    f"UPDATE jobs SET status = 'failed', error = $1, finished_at = {NOW}, expires_at = $2"
                    " WHERE status = 'pending' AND gateway_id = $3",
                    error,
                    expires_at,
                    gateway_id,
                )
            )
            for row in hooked:  # their clients wait for a webhook: it says the job failed
                await conn.execute(
                    f"INSERT INTO webhook_outbox (tracking_id, url, payload, next_at) VALUES ($1, $2, $3, {NOW})",
                    row["tracking_id"], row["webhook_url"], failure_webhook(row["tracking_id"], error),
                )  # fmt: skip
            await conn.execute(
                "UPDATE webhook_outbox SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = $1", gateway_id
            )
        return Sweep(len(held), charged, failed)

    # The model catalog and named leases

    async def catalog(self) -> list[CatalogEntry]:
        rows = await self._fetch("SELECT * FROM models ORDER BY name")
        return [CatalogEntry(r["name"], r["config"], r["origin"], r["revision"], r["updated_at"]) for r in rows]

    async def catalog_put(self, name: str, config: str, origin: str, *, create: bool | None) -> CatalogEntry | None:
        async with self._transaction() as conn:
            revision = await conn.fetchval("SELECT revision FROM models WHERE name = $1 FOR UPDATE", name)
            if (create is True and revision is not None) or (create is False and revision is None):
                return None
            row = await conn.fetchrow(
                f"INSERT INTO models (name, config, origin, revision, updated_at) VALUES ($1, $2, $3, $4, {NOW})"
                " ON CONFLICT (name) DO UPDATE SET config = excluded.config, origin = excluded.origin,"
                " revision = excluded.revision, updated_at = excluded.updated_at RETURNING updated_at",
                name, config, origin, (revision or 0) + 1,
            )  # fmt: skip
        assert row is not None
        return CatalogEntry(name, config, origin, (revision or 0) + 1, row["updated_at"])

    async def catalog_delete(self, name: str) -> bool:
        return _count(await self._execute("DELETE FROM models WHERE name = $1", name)) == 1

    async def lease_take(self, name: str, holder: str, seconds: float) -> bool:
        taken = await self._fetchrow(
            f"INSERT INTO leases (name, holder, lease_until) VALUES ($1, $2, {NOW} + $3)"
            " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, lease_until = excluded.lease_until"
            f" WHERE leases.holder = excluded.holder OR leases.lease_until < {NOW} RETURNING holder",
            name, holder, seconds,
        )  # fmt: skip
        return taken is not None

    async def lease_release(self, name: str, holder: str) -> None:
        await self._execute("DELETE FROM leases WHERE name = $1 AND holder = $2", name, holder)

    async def node_marks(self) -> list[NodeMark]:
        rows = await self._fetch("SELECT node, state, since FROM node_marks ORDER BY node")
        return [NodeMark(r["node"], r["state"], r["since"]) for r in rows]

    async def node_mark(self, node: str, state: str | None) -> NodeMark | None:
        if state is None:
            await self._execute("DELETE FROM node_marks WHERE node = $1", node)
            return None
        row = await self._fetchrow(  # a mark set again keeps its time
            f"INSERT INTO node_marks (node, state, since) VALUES ($1, $2, {NOW})"
            " ON CONFLICT (node) DO UPDATE SET state = excluded.state,"
            " since = CASE WHEN node_marks.state = excluded.state THEN node_marks.since ELSE excluded.since END"
            " RETURNING since",
            node, state,
        )  # fmt: skip
        assert row is not None
        return NodeMark(node, state, row["since"])


LEDGER_COLUMNS = [
    "time", "key_id", "model", "instance_id", "endpoint", "prompt_tokens", "completion_tokens",
    "latency_ms", "ttft_ms", "tokens_per_second", "outcome", "cost",
]  # fmt: skip


async def _version(conn: asyncpg.Connection) -> int:
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return 0
    return int(await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations"))


async def _migrate(conn: asyncpg.Connection) -> int:
    """Apply the migrations this database lacks, one transaction each, under an advisory lock (two
    `db migrate` at once apply each migration once); the version reached."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATE_LOCK)
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
        current = await _version(conn)
        if current > len(POSTGRES):
            return current
        for version, script in enumerate(POSTGRES, start=1):
            if version > current:
                await conn.execute(script)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
                log.info("applied PostgreSQL migration %d", version)
    return await _version(conn)


def _count(status: str) -> int:
    """The row count of an asyncpg command status ("DELETE 3", "UPDATE 0")."""
    return int(status.rsplit(" ", 1)[-1])
