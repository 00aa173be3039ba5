"""The SQLite store in WAL mode: one file under the data dir, shared by the server and the CLI.

Every query runs on the store's own thread, one at a time, never on the event loop: a write from
the CLI (or a busy disk) makes a request wait, not the whole gateway. The server reads keys from
here on every request, so a key created or revoked from the CLI takes effect at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from llmserver.store.interfaces import (
    NO_LIMITS,
    JobRecord,
    KeyLimits,
    KeyRecord,
    QuotaGrant,
    UsageBatch,
    utc_now,
)
from llmserver.store.migrations import MIGRATIONS

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
        self, key_id: str, name: str, key_hash: str, fingerprint: str, is_admin: bool, limits: KeyLimits = NO_LIMITS
    ) -> KeyRecord:
        created = utc_now()
        self._db.execute(
            "INSERT INTO api_keys (id, name, key_hash, fingerprint, is_admin, created_at,"
            " quota_tokens, quota_period, rpm, max_concurrency, models) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key_id, name, key_hash, fingerprint, int(is_admin), created, *_limit_values(limits)),
        )
        return KeyRecord(key_id, name, fingerprint, is_admin, created, None, limits)

    @_in_thread
    def update_key_limits(self, key_id: str, limits: KeyLimits) -> bool:
        cursor = self._db.execute(
            "UPDATE api_keys SET quota_tokens = ?, quota_period = ?, rpm = ?, max_concurrency = ?, models = ?"
            " WHERE id = ?",
            (*_limit_values(limits), key_id),
        )
        return cursor.rowcount == 1

    @_in_thread
    def key_by_hash(self, key_hash: str) -> KeyRecord | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()
        return _key(row) if row is not None else None

    @_in_thread
    def key_by_id(self, key_id: str) -> KeyRecord | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _key(row) if row is not None else None

    @_in_thread
    def list_keys(self) -> list[KeyRecord]:
        rows = self._db.execute("SELECT * FROM api_keys ORDER BY created_at, id").fetchall()
        return [_key(row) for row in rows]

    @_in_thread
    def revoke_key(self, key_id: str) -> bool:
        cursor = self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (utc_now(), key_id)
        )
        return cursor.rowcount == 1

    # Quota counters: what was used per key and window, and what each gateway holds reserved

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
    def quota_clear_reservations(self, gateway_id: str) -> int:
        cursor = self._db.execute("DELETE FROM quota_reservations WHERE gateway_id = ?", (gateway_id,))
        return cursor.rowcount

    # The usage ledger and the per-minute speed buckets

    @_in_thread
    def record(self, batch: UsageBatch) -> None:
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO usage_ledger (time, key_id, model, instance_id, endpoint, prompt_tokens,"
                " completion_tokens, latency_ms, ttft_ms, tokens_per_second, outcome) VALUES"
                " (:time, :key_id, :model, :instance_id, :endpoint, :prompt_tokens, :completion_tokens,"
                " :latency_ms, :ttft_ms, :tokens_per_second, :outcome)",
                batch.rows,
            )
            db.executemany(
                "INSERT INTO speed_buckets (model, minute, tokens, seconds) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (model, minute) DO UPDATE SET tokens = tokens + excluded.tokens,"
                " seconds = seconds + excluded.seconds",
                batch.speeds,
            )
            if batch.settlements:
                db.executemany(
                    "UPDATE quota_reservations SET amount = MAX(0, amount - ?)"
                    " WHERE key_id = ? AND period_start = ? AND gateway_id = ?",
                    [(s.reserved, s.key_id, s.period_start, s.gateway_id) for s in batch.settlements],
                )
                db.executemany(
                    "INSERT INTO quota_usage (key_id, period_start, used) VALUES (?, ?, ?)"
                    " ON CONFLICT (key_id, period_start) DO UPDATE SET used = used + excluded.used",
                    [(s.key_id, s.period_start, s.used) for s in batch.settlements if s.used],
                )

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
    def delete_usage_before(self, moment: float) -> int:
        cursor = self._db.execute("DELETE FROM usage_ledger WHERE time < ?", (moment,))
        return cursor.rowcount

    @_in_thread
    def speed_since(self, minute: int) -> list[tuple[str, int, int, float]]:
        rows = self._db.execute(
            "SELECT model, minute, tokens, seconds FROM speed_buckets WHERE minute >= ?", (minute,)
        ).fetchall()
        self._db.execute("DELETE FROM speed_buckets WHERE minute < ?", (minute,))
        return [(r["model"], int(r["minute"]), int(r["tokens"]), float(r["seconds"])) for r in rows]

    # Async jobs

    @_in_thread
    def insert_job(self, tracking_id: str, key_id: str, nonce: str, now: float, gateway_id: str) -> None:
        self._db.execute(
            "INSERT INTO jobs (tracking_id, key_id, status, nonce, created_at, gateway_id)"
            " VALUES (?, ?, 'pending', ?, ?, ?)",
            (tracking_id, key_id, nonce, now, gateway_id),
        )

    @_in_thread
    def finish_job(
        self, tracking_id: str, *, result: str | None, error: str | None, now: float, expires_at: float
    ) -> None:
        self._db.execute(
            "UPDATE jobs SET status = ?, result = ?, error = ?, finished_at = ?, expires_at = ?"
            " WHERE tracking_id = ? AND status = 'pending'",
            ("ready" if result is not None else "failed", result, error, now, expires_at, tracking_id),
        )

    @_in_thread
    def job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        row = self._db.execute(
            "SELECT * FROM jobs WHERE tracking_id = ? AND key_id = ? AND (expires_at IS NULL OR expires_at > ?)",
            (tracking_id, key_id, now),
        ).fetchone()
        return _job(row) if row is not None else None

    @_in_thread
    def claim_job(self, tracking_id: str, key_id: str, now: float, gateway_id: str) -> JobRecord | None:
        row = self._db.execute(
            "UPDATE jobs SET status = 'claimed', claimed_by = ? WHERE tracking_id = ? AND key_id = ?"
            " AND status IN ('ready', 'failed') AND expires_at > ? RETURNING *",
            (gateway_id, tracking_id, key_id, now),
        ).fetchone()
        return _job(row) if row is not None else None

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

    @_in_thread
    def fail_interrupted_jobs(self, gateway_id: str, error: str, now: float, expires_at: float) -> int:
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END, claimed_by = NULL"
                " WHERE status = 'claimed' AND claimed_by = ?",
                (gateway_id,),
            )
            cursor = db.execute(
                "UPDATE jobs SET status = 'failed', error = ?, finished_at = ?, expires_at = ?"
                " WHERE status = 'pending' AND gateway_id = ?",
                (error, now, expires_at, gateway_id),
            )
        return cursor.rowcount


def _limit_values(limits: KeyLimits) -> tuple[int | None, str | None, int | None, int | None, str | None]:
    models = json.dumps(list(limits.models)) if limits.models is not None else None
    return (limits.quota_tokens, limits.quota_period, limits.rpm, limits.max_concurrency, models)


def _key(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        fingerprint=row["fingerprint"],
        is_admin=bool(row["is_admin"]),
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        limits=KeyLimits(
            row["quota_tokens"],
            row["quota_period"],
            row["rpm"],
            row["max_concurrency"],
            tuple(json.loads(row["models"])) if row["models"] is not None else None,
        ),
    )


def _job(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        tracking_id=row["tracking_id"],
        key_id=row["key_id"],
        status=row["status"],
        nonce=row["nonce"],
        result=row["result"],
        error=row["error"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
    )
