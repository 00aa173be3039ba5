"""The SQLite store in WAL mode: one file under the data dir, shared by the server and the CLI.

Every query runs on the store's own thread, one at a time, never on the event loop: a write from
the CLI (or a busy disk) makes a request wait, not the whole gateway. The server reads keys from
here on every request, so a key created or revoked from the CLI takes effect at once.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

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
from llmserver.store.migrations import MIGRATIONS
from llmserver.store.rows import (
    LIMIT_COLUMNS,
    job_record,
    key_record,
    limit_marks,
    limit_sets,
    limit_values,
    team_record,
)

P = ParamSpec("P")
R = TypeVar("R")


def _in_thread(
    method: Callable[Concatenate[SQLiteStore, P], R],
) -> Callable[Concatenate[SQLiteStore, P], Coroutine[Any, Any, R]]:
    """The method as a coroutine that runs it on the store's thread."""

    async def run(self: SQLiteStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        call = functools.partial(method, self, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    run.__doc__ = method.__doc__
    return run


class SQLiteStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    @_in_thread
    def ping(self) -> None:
        """A query that answers (the readiness probe's)."""
        self._db.execute("SELECT 1").fetchone()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._db.close)
        self._thread.shutdown()

    @contextmanager
    def _transaction(self, kind: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        self._db.execute(f"BEGIN {kind}")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _migrate(self) -> None:
        self._db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
        with self._transaction() as db:
            current = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] or 0
            if current > len(MIGRATIONS):
                raise SchemaError(
                    f"the database {self.path} has schema version {current}, newer than this llmserver knows "
                    f"({len(MIGRATIONS)}): run a newer llmserver on it"
                )
            for version, script in enumerate(MIGRATIONS, start=1):
                if version > current:
                    for statement in script.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    db.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])

    # API keys

    @_in_thread
    def insert_key(
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
        self._db.execute(
            f"INSERT INTO api_keys (id, name, key_hash, fingerprint, is_admin, created_at, {', '.join(LIMIT_COLUMNS)},"
            f" expires_at, team_id, is_team_admin) VALUES (?, ?, ?, ?, ?, ?, {limit_marks()}, ?, ?, ?)",
            (key_id, name, key_hash, fingerprint, int(is_admin), created, *limit_values(limits), expires_at, team_id,
             int(team_admin)),
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

    @_in_thread
    def update_key_limits(self, key_id: str, limits: KeyLimits) -> bool:
        cursor = self._db.execute(
            f"UPDATE api_keys SET {limit_sets()} WHERE id = ?",
            (*limit_values(limits), key_id),
        )
        return cursor.rowcount == 1

    @_in_thread
    def key_by_hash(self, key_hash: str) -> KeyRecord | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()
        return key_record(row) if row is not None else None

    @_in_thread
    def key_by_previous_hash(self, key_hash: str, now: float) -> KeyRecord | None:
        row = self._db.execute(
            "SELECT * FROM api_keys WHERE previous_hash = ? AND previous_until > ? AND revoked_at IS NULL",
            (key_hash, now),
        ).fetchone()
        return key_record(row) if row is not None else None

    @_in_thread
    def set_key_expiry(self, key_id: str, expires_at: float | None) -> bool:
        return self._db.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (expires_at, key_id)).rowcount == 1

    @_in_thread
    def rotate_key(self, key_id: str, key_hash: str, fingerprint: str, previous_until: float) -> bool:
        cursor = self._db.execute(
            "UPDATE api_keys SET previous_hash = key_hash, previous_until = ?, key_hash = ?, fingerprint = ?"
            " WHERE id = ? AND revoked_at IS NULL",
            (previous_until, key_hash, fingerprint, key_id),
        )
        return cursor.rowcount == 1

    @_in_thread
    def touch_keys(self, used: dict[str, float]) -> None:
        with self._transaction() as db:
            db.executemany(
                "UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, 0), ?) WHERE id = ?",
                [(when, key_id) for key_id, when in used.items()],
            )

    @_in_thread
    def key_by_id(self, key_id: str) -> KeyRecord | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return key_record(row) if row is not None else None

    @_in_thread
    def list_keys(self) -> list[KeyRecord]:
        rows = self._db.execute("SELECT * FROM api_keys ORDER BY created_at, id").fetchall()
        return [key_record(row) for row in rows]

    @_in_thread
    def revoke_key(self, key_id: str) -> bool:
        cursor = self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (utc_now(), key_id)
        )
        return cursor.rowcount == 1

    # Teams

    @_in_thread
    def insert_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | None:
        created = utc_now()
        cursor = self._db.execute(
            f"INSERT INTO teams (id, name, created_at, {', '.join(LIMIT_COLUMNS)})"
            f" VALUES (?, ?, ?, {limit_marks()}) ON CONFLICT (name) DO NOTHING",
            (team_id, name, created, *limit_values(limits)),
        )
        return TeamRecord(team_id, name, created, limits) if cursor.rowcount == 1 else None

    @_in_thread
    def update_team(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | bool:
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM teams WHERE name = ? AND id != ?", (name, team_id)).fetchone():
                return True
            db.execute(
                f"UPDATE teams SET name = ?, {limit_sets()} WHERE id = ?",
                (name, *limit_values(limits), team_id),
            )
            row = db.execute("SELECT * FROM teams WHERE id = ?", (team_id,)).fetchone()
        return team_record(row) if row is not None else False

    @_in_thread
    def team_by_id(self, team_id: str) -> TeamRecord | None:
        row = self._db.execute("SELECT * FROM teams WHERE id = ?", (team_id,)).fetchone()
        return team_record(row) if row is not None else None

    @_in_thread
    def list_teams(self) -> list[TeamRecord]:
        return [team_record(row) for row in self._db.execute("SELECT * FROM teams ORDER BY name").fetchall()]

    @_in_thread
    def delete_team(self, team_id: str) -> int | None:
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM teams WHERE id = ?", (team_id,)).fetchone() is None:
                return None
            members = db.execute(
                "SELECT COUNT(*) FROM api_keys WHERE team_id = ? AND revoked_at IS NULL", (team_id,)
            ).fetchone()[0]
            if not members:
                db.execute("DELETE FROM teams WHERE id = ?", (team_id,))
        return int(members)

    @_in_thread
    def set_key_team(self, key_id: str, team_id: str | None, team_admin: bool = False) -> bool:
        cursor = self._db.execute(
            "UPDATE api_keys SET team_id = ?, is_team_admin = ? WHERE id = ? AND revoked_at IS NULL"
            " AND (? IS NULL OR EXISTS (SELECT 1 FROM teams WHERE id = ?))",
            (team_id, int(team_admin and team_id is not None), key_id, team_id, team_id),
        )
        return cursor.rowcount == 1

    # Quota counters: what was used per key (or team) and window, and what each gateway holds reserved

    def _counts(self, key_id: str, period_start: str) -> tuple[int, int]:
        used = self._db.execute(
            "SELECT used FROM quota_usage WHERE key_id = ? AND period_start = ?", (key_id, period_start)
        ).fetchone()
        reserved = self._db.execute(
            "SELECT COALESCE(SUM(amount), 0) FROM quota_reservations WHERE key_id = ? AND period_start = ?",
            (key_id, period_start),
        ).fetchone()
        return (int(used[0]) if used is not None else 0), int(reserved[0])

    @_in_thread
    def quota_reserve(self, key_id: str, period_start: str, gateway_id: str, amount: int, limit: int) -> QuotaGrant:
        with self._transaction() as db:
            used, reserved = self._counts(key_id, period_start)
            if used + reserved + amount > limit:
                return QuotaGrant(False, used, reserved)
            db.execute(
                "INSERT INTO quota_reservations (key_id, period_start, gateway_id, amount) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (key_id, period_start, gateway_id) DO UPDATE SET amount = amount + excluded.amount",
                (key_id, period_start, gateway_id, amount),
            )
        return QuotaGrant(True, used, reserved + amount)

    @_in_thread
    def quota_release(self, key_id: str, period_start: str, gateway_id: str, amount: int) -> None:
        self._db.execute(
            "UPDATE quota_reservations SET amount = MAX(0, amount - ?)"
            " WHERE key_id = ? AND period_start = ? AND gateway_id = ?",
            (amount, key_id, period_start, gateway_id),
        )

    @_in_thread
    def quota_counts(self, key_id: str, period_start: str) -> tuple[int, int]:
        with self._transaction("DEFERRED"):
            return self._counts(key_id, period_start)

    @_in_thread
    def quota_progress(self, gateway_id: str, produced: dict[tuple[str, str], int]) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE quota_reservations SET produced = 0 WHERE gateway_id = ? AND produced != 0", (gateway_id,)
            )
            db.executemany(
                "UPDATE quota_reservations SET produced = ? WHERE key_id = ? AND period_start = ? AND gateway_id = ?",
                [(tokens, key_id, period, gateway_id) for (key_id, period), tokens in produced.items()],
            )

    # The usage ledger and the per-minute speed buckets

    @_in_thread
    def record(self, batch: UsageBatch) -> list[Alert]:
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO usage_ledger (time, key_id, model, instance_id, endpoint, prompt_tokens,"
                " completion_tokens, latency_ms, ttft_ms, tokens_per_second, outcome, cost) VALUES"
                " (:time, :key_id, :model, :instance_id, :endpoint, :prompt_tokens, :completion_tokens,"
                " :latency_ms, :ttft_ms, :tokens_per_second, :outcome, :cost)",
                [{"cost": None, **row} for row in batch.rows],
            )
            db.executemany(
                "INSERT INTO speed_buckets (model, minute, tokens, seconds) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (model, minute) DO UPDATE SET tokens = tokens + excluded.tokens,"
                " seconds = seconds + excluded.seconds",
                batch.speeds,
            )
            crossed: list[Alert] = []
            if batch.settlements:
                db.executemany(
                    "UPDATE quota_reservations SET amount = MAX(0, amount - ?)"
                    " WHERE key_id = ? AND period_start = ? AND gateway_id = ?",
                    [(s.reserved, s.key_id, s.period_start, s.gateway_id) for s in batch.settlements],
                )
                db.executemany(
                    "INSERT INTO quota_usage (key_id, period_start, used) VALUES (?, ?, ?)"
                    " ON CONFLICT (key_id, period_start) DO UPDATE SET used = used + excluded.used",
                    [(s.key_id, s.period_start, s.used) for s in batch.settlements if s.used and not s.alerts],
                )
                for s in batch.settlements:
                    if not (s.used and s.alerts):
                        continue
                    after = db.execute(
                        "INSERT INTO quota_usage (key_id, period_start, used) VALUES (?, ?, ?)"
                        " ON CONFLICT (key_id, period_start) DO UPDATE SET used = used + excluded.used RETURNING used",
                        (s.key_id, s.period_start, s.used),
                    ).fetchone()[0]
                    for alert in crossings(s, int(after)):
                        crossed.append(alert)
                        if alert.url is not None:
                            db.execute(
                                "INSERT INTO webhook_outbox (tracking_id, url, payload, next_at) VALUES (?, ?, ?, ?)",
                                (alert_id(s, alert), alert.url, alert.payload, time.time()),
                            )
        return crossed

    @_in_thread
    def usage_rows(self, key_id: str | None, since: float, until: float) -> list[dict[str, object]]:
        query = "SELECT * FROM usage_ledger WHERE time >= ? AND time < ?"
        params: list[object] = [since, until]
        if key_id is not None:
            query += " AND key_id = ?"
            params.append(key_id)
        rows = self._db.execute(query + " ORDER BY time", params).fetchall()
        return [dict(row) for row in rows]

    @_in_thread
    def usage_page(self, query: LedgerQuery) -> list[dict[str, object]]:
        params: list[object] = []

        def mark(value: object) -> str:
            params.append(value)
            return "?"

        before_time = None
        if query.before is not None:
            found = self._db.execute("SELECT time FROM usage_ledger WHERE id = ?", (query.before,)).fetchone()
            if found is None:
                return []
            before_time = float(found["time"])
        where = query.where(mark, before_time)
        rows = self._db.execute(
            f"SELECT * FROM usage_ledger WHERE {where} ORDER BY time DESC, id DESC LIMIT ?", [*params, query.limit]
        )
        return [dict(row) for row in rows.fetchall()]

    @_in_thread
    def delete_usage_before(self, moment: float) -> int:
        cursor = self._db.execute("DELETE FROM usage_ledger WHERE time < ?", (moment,))
        return cursor.rowcount

    # The audit log

    @_in_thread
    def audit_append(self, row: dict[str, object]) -> None:
        columns = ", ".join(AUDIT_COLUMNS)
        self._db.execute(
            f"INSERT INTO audit_log ({columns}) VALUES ({', '.join('?' * len(AUDIT_COLUMNS))})",
            [row.get(column) for column in AUDIT_COLUMNS],
        )

    @_in_thread
    def audit_page(self, query: AuditQuery) -> list[dict[str, object]]:
        params: list[object] = []

        def mark(value: object) -> str:
            params.append(value)
            return "?"

        where = query.where(mark)
        rows = self._db.execute(
            f"SELECT * FROM audit_log WHERE {where} ORDER BY id DESC LIMIT ?", [*params, query.limit]
        )
        return [dict(row) for row in rows.fetchall()]

    @_in_thread
    def delete_audit_before(self, moment: float) -> int:
        return self._db.execute("DELETE FROM audit_log WHERE time < ?", (moment,)).rowcount

    @_in_thread
    def speed_since(self, minute: int, prune: bool = True) -> list[tuple[str, int, int, float]]:
        rows = self._db.execute(
            "SELECT model, minute, tokens, seconds FROM speed_buckets WHERE minute >= ?", (minute,)
        ).fetchall()
        if prune:
            self._db.execute("DELETE FROM speed_buckets WHERE minute < ?", (minute,))
        return [(r["model"], int(r["minute"]), int(r["tokens"]), float(r["seconds"])) for r in rows]

    # Async jobs

    @_in_thread
    def insert_job(
        self, tracking_id: str, key_id: str, nonce: str, now: float, gateway_id: str, webhook_url: str | None = None
    ) -> None:
        self._db.execute(
            "INSERT INTO jobs (tracking_id, key_id, status, nonce, created_at, gateway_id, webhook_url)"
            " VALUES (?, ?, 'pending', ?, ?, ?, ?)",
            (tracking_id, key_id, nonce, now, gateway_id, webhook_url),
        )

    @_in_thread
    def finish_job(
        self,
        tracking_id: str,
        *,
        result: str | None,
        error: str | None,
        now: float,
        expires_at: float,
        webhook: tuple[str, str] | None = None,
    ) -> None:
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = ?, result = ?, error = ?, finished_at = ?, expires_at = ?"
                " WHERE tracking_id = ? AND status = 'pending'",
                ("ready" if result is not None else "failed", result, error, now, expires_at, tracking_id),
            )
            if webhook is not None and cursor.rowcount == 1:
                db.execute(
                    "INSERT INTO webhook_outbox (tracking_id, url, payload, next_at) VALUES (?, ?, ?, ?)",
                    (tracking_id, *webhook, now),
                )

    @_in_thread
    def job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        row = self._db.execute(
            "SELECT * FROM jobs WHERE tracking_id = ? AND key_id = ? AND (expires_at IS NULL OR expires_at > ?)",
            (tracking_id, key_id, now),
        ).fetchone()
        return job_record(row) if row is not None else None

    @_in_thread
    def claim_job(self, tracking_id: str, key_id: str, now: float, gateway_id: str) -> JobRecord | None:
        row = self._db.execute(
            "UPDATE jobs SET status = 'claimed', claimed_by = ? WHERE tracking_id = ? AND key_id = ?"
            " AND status IN ('ready', 'failed') AND expires_at > ? RETURNING *",
            (gateway_id, tracking_id, key_id, now),
        ).fetchone()
        return job_record(row) if row is not None else None

    @_in_thread
    def release_claim(self, tracking_id: str) -> None:
        self._db.execute(
            "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END, claimed_by = NULL"
            " WHERE tracking_id = ? AND status = 'claimed'",
            (tracking_id,),
        )

    @_in_thread
    def delete_job(self, tracking_id: str) -> None:
        self._db.execute("DELETE FROM jobs WHERE tracking_id = ?", (tracking_id,))

    @_in_thread
    def delete_expired_jobs(self, now: float) -> int:
        cursor = self._db.execute("DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))
        return cursor.rowcount

    # The webhook outbox

    @_in_thread
    def outbox_claim(self, gateway_id: str, lease: float, limit: int) -> list[OutboxItem]:
        now = time.time()
        rows = self._db.execute(
            "UPDATE webhook_outbox SET claimed_by = ?, claimed_until = ? WHERE id IN (SELECT id FROM webhook_outbox"
            " WHERE next_at <= ? AND (claimed_until IS NULL OR claimed_until < ?) ORDER BY next_at LIMIT ?)"
            " RETURNING id, tracking_id, url, payload, attempts",
            (gateway_id, now + lease, now, now, limit),
        ).fetchall()
        return [OutboxItem(r["id"], r["tracking_id"], r["url"], r["payload"], r["attempts"]) for r in rows]

    @_in_thread
    def outbox_retry(self, item_id: int, attempts: int, delay: float) -> None:
        self._db.execute(
            "UPDATE webhook_outbox SET attempts = ?, next_at = ?, claimed_by = NULL, claimed_until = NULL WHERE id = ?",
            (attempts, time.time() + delay, item_id),
        )

    @_in_thread
    def outbox_done(self, item_id: int) -> None:
        self._db.execute("DELETE FROM webhook_outbox WHERE id = ?", (item_id,))

    @_in_thread
    def outbox_depth(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM webhook_outbox").fetchone()[0])

    # Gateway leases, and the sweep of a gateway's state

    @_in_thread
    def gateway_holder(self, gateway_id: str) -> GatewayHolder | None:
        row = self._db.execute("SELECT host, pid, lease_until FROM gateways WHERE id = ?", (gateway_id,)).fetchone()
        return GatewayHolder(row["host"], row["pid"], row["lease_until"] - time.time()) if row is not None else None

    @_in_thread
    def gateway_take(self, gateway_id: str, host: str, pid: int, lease: float, previous: GatewayHolder | None) -> bool:
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT host, pid FROM gateways WHERE id = ?", (gateway_id,)).fetchone()
            if (row is None) != (previous is None) or (
                row is not None and previous is not None and (row["host"], row["pid"]) != (previous.host, previous.pid)
            ):
                return False
            db.execute(
                "INSERT INTO gateways (id, host, pid, started_at, lease_until) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET host = excluded.host, pid = excluded.pid,"
                " started_at = excluded.started_at, lease_until = excluded.lease_until",
                (gateway_id, host, pid, now, now + lease),
            )
        return True

    @_in_thread
    def gateway_renew(self, gateway_id: str, pid: int, lease: float) -> list[str] | None:
        now = time.time()
        cursor = self._db.execute(
            "UPDATE gateways SET lease_until = ? WHERE id = ? AND pid = ?", (now + lease, gateway_id, pid)
        )
        if cursor.rowcount != 1:
            return None
        return [row["id"] for row in self._db.execute("SELECT id FROM gateways WHERE lease_until < ?", (now,))]

    @_in_thread
    def gateway_release(self, gateway_id: str, pid: int) -> None:
        self._db.execute("DELETE FROM gateways WHERE id = ? AND pid = ?", (gateway_id, pid))

    @_in_thread
    def sweep_gateway(self, gateway_id: str, *, error: str, expires_at: float, only_if_lapsed: bool) -> Sweep | None:
        now = time.time()
        with self._transaction() as db:
            if only_if_lapsed and (
                db.execute("DELETE FROM gateways WHERE id = ? AND lease_until < ?", (gateway_id, now)).rowcount == 0
            ):
                return None
            held = db.execute(
                "DELETE FROM quota_reservations WHERE gateway_id = ? RETURNING key_id, period_start, amount, produced",
                (gateway_id,),
            ).fetchall()
            charges = [(r["key_id"], r["period_start"], min(r["amount"], r["produced"])) for r in held]
            db.executemany(
                "INSERT INTO quota_usage (key_id, period_start, used) VALUES (?, ?, ?)"
                " ON CONFLICT (key_id, period_start) DO UPDATE SET used = used + excluded.used",
                [charge for charge in charges if charge[2] > 0],
            )
            db.execute(
                "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END, claimed_by = NULL"
                " WHERE status = 'claimed' AND claimed_by = ?",
                (gateway_id,),
            )
            hooked = db.execute(
                "SELECT tracking_id, webhook_url FROM jobs"
                " WHERE status = 'pending' AND gateway_id = ? AND webhook_url IS NOT NULL",
                (gateway_id,),
            ).fetchall()
            failed = db.execute(
                "UPDATE jobs SET status = 'failed', error = ?, finished_at = ?, expires_at = ?"
                " WHERE status = 'pending' AND gateway_id = ?",
                (error, now, expires_at, gateway_id),
            ).rowcount
            db.executemany(  # their clients wait for a webhook: it says the job failed
                "INSERT INTO webhook_outbox (tracking_id, url, payload, next_at) VALUES (?, ?, ?, ?)",
                [(r["tracking_id"], r["webhook_url"], failure_webhook(r["tracking_id"], error), now) for r in hooked],
            )
            db.execute(
                "UPDATE webhook_outbox SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = ?", (gateway_id,)
            )
        return Sweep(len(held), sum(charge[2] for charge in charges), failed)

    # The model catalog and named leases

    @_in_thread
    def catalog(self) -> list[CatalogEntry]:
        rows = self._db.execute("SELECT * FROM models ORDER BY name").fetchall()
        return [CatalogEntry(r["name"], r["config"], r["origin"], r["revision"], r["updated_at"]) for r in rows]

    @_in_thread
    def catalog_put(self, name: str, config: str, origin: str, *, create: bool | None) -> CatalogEntry | None:
        with self._transaction() as db:
            row = db.execute("SELECT revision FROM models WHERE name = ?", (name,)).fetchone()
            if (create is True and row is not None) or (create is False and row is None):
                return None
            revision, now = (row["revision"] if row is not None else 0) + 1, time.time()
            db.execute(
                "INSERT INTO models (name, config, origin, revision, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET config = excluded.config, origin = excluded.origin,"
                " revision = excluded.revision, updated_at = excluded.updated_at",
                (name, config, origin, revision, now),
            )
        return CatalogEntry(name, config, origin, revision, now)

    @_in_thread
    def catalog_delete(self, name: str) -> bool:
        return self._db.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount == 1

    @_in_thread
    def lease_take(self, name: str, holder: str, seconds: float) -> bool:
        now = time.time()
        cursor = self._db.execute(
            "INSERT INTO leases (name, holder, lease_until) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, lease_until = excluded.lease_until"
            " WHERE leases.holder = excluded.holder OR leases.lease_until < ?",
            (name, holder, now + seconds, now),
        )
        return cursor.rowcount == 1

    @_in_thread
    def lease_release(self, name: str, holder: str) -> None:
        self._db.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

    @_in_thread
    def node_marks(self) -> list[NodeMark]:
        rows = self._db.execute("SELECT node, state, since FROM node_marks ORDER BY node").fetchall()
        return [NodeMark(r["node"], r["state"], r["since"]) for r in rows]

    @_in_thread
    def node_mark(self, node: str, state: str | None) -> NodeMark | None:
        if state is None:
            self._db.execute("DELETE FROM node_marks WHERE node = ?", (node,))
            return None
        with self._transaction() as db:
            row = db.execute("SELECT state, since FROM node_marks WHERE node = ?", (node,)).fetchone()
            if row is not None and row["state"] == state:
                return NodeMark(node, state, row["since"])
            now = time.time()
            db.execute(
                "INSERT INTO node_marks (node, state, since) VALUES (?, ?, ?)"
                " ON CONFLICT (node) DO UPDATE SET state = excluded.state, since = excluded.since",
                (node, state, now),
            )
        return NodeMark(node, state, now)
