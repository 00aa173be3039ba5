"""SQLite store in WAL mode: one file under the data dir, shared by the server and the CLI.

The server reads keys from here on every request, so a key created or revoked from the CLI takes
effect at once. Queries are indexed point lookups (tens of microseconds), so they run inline.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from llmserver.store.migrations import MIGRATIONS


@dataclass(frozen=True)
class KeyLimits:
    quota_tokens: int | None = None
    quota_period: str | None = None  # day | month | total
    rpm: int | None = None
    max_concurrency: int | None = None


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

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class SQLiteStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
                current = row[0] or 0
                for version, script in enumerate(MIGRATIONS, start=1):
                    if version > current:
                        for statement in script.split(";"):
                            if statement.strip():
                                self._db.execute(statement)
                        self._db.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])

    # API keys

    def insert_key(
        self, key_id: str, name: str, key_hash: str, fingerprint: str, is_admin: bool, limits: KeyLimits = NO_LIMITS
    ) -> KeyRecord:
        created = utc_now()
        with self._lock:
            self._db.execute(
                "INSERT INTO api_keys (id, name, key_hash, fingerprint, is_admin, created_at,"
                " quota_tokens, quota_period, rpm, max_concurrency) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key_id, name, key_hash, fingerprint, int(is_admin), created, *_limit_values(limits)),
            )
        return KeyRecord(key_id, name, fingerprint, is_admin, created, None, limits)

    def update_key_limits(self, key_id: str, limits: KeyLimits) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "UPDATE api_keys SET quota_tokens = ?, quota_period = ?, rpm = ?, max_concurrency = ? WHERE id = ?",
                (*_limit_values(limits), key_id),
            )
        return cursor.rowcount == 1

    # Quota counters: one row per key and period window

    def quota_reserve(self, key_id: str, period_start: str, amount: int, limit: int) -> tuple[bool, int, int]:
        """Atomically reserve `amount` if used + reserved + amount ≤ limit: (granted, used, reserved)."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO quota_usage (key_id, period_start) VALUES (?, ?)", (key_id, period_start)
            )
            cursor = self._db.execute(
                "UPDATE quota_usage SET reserved = reserved + ? WHERE key_id = ? AND period_start = ?"
                " AND used + reserved + ? <= ?",
                (amount, key_id, period_start, amount, limit),
            )
            row = self._db.execute(
                "SELECT used, reserved FROM quota_usage WHERE key_id = ? AND period_start = ?", (key_id, period_start)
            ).fetchone()
        return cursor.rowcount == 1, int(row["used"]), int(row["reserved"])

    def quota_settle(self, key_id: str, period_start: str, reserved: int, used: int) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE quota_usage SET reserved = MAX(0, reserved - ?), used = used + ?"
                " WHERE key_id = ? AND period_start = ?",
                (reserved, used, key_id, period_start),
            )

    def quota_counts(self, key_id: str, period_start: str) -> tuple[int, int]:
        with self._lock:
            row = self._db.execute(
                "SELECT used, reserved FROM quota_usage WHERE key_id = ? AND period_start = ?", (key_id, period_start)
            ).fetchone()
        return (int(row["used"]), int(row["reserved"])) if row is not None else (0, 0)

    def quota_clear_reservations(self) -> None:
        """At start-up: reservations of requests that were in flight when the server stopped."""
        with self._lock:
            self._db.execute("UPDATE quota_usage SET reserved = 0 WHERE reserved != 0")

    # The usage ledger and the per-minute speed buckets

    def record_usage_and_speed(
        self, entries: list[dict[str, object]], speeds: list[tuple[str, int, float, float]]
    ) -> None:
        """Ledger rows and speed-bucket increments (model, minute, tokens, seconds), in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT INTO usage_ledger (time, key_id, model, instance_id, endpoint, prompt_tokens,"
                    " completion_tokens, latency_ms, ttft_ms, tokens_per_second, outcome) VALUES"
                    " (:time, :key_id, :model, :instance_id, :endpoint, :prompt_tokens, :completion_tokens,"
                    " :latency_ms, :ttft_ms, :tokens_per_second, :outcome)",
                    entries,
                )
                self._db.executemany(
                    "INSERT INTO speed_buckets (model, minute, tokens, seconds) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (model, minute) DO UPDATE SET tokens = tokens + excluded.tokens,"
                    " seconds = seconds + excluded.seconds",
                    speeds,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def usage_rows(self, key_id: str | None, since: float, until: float) -> list[dict[str, object]]:
        query = "SELECT * FROM usage_ledger WHERE time >= ? AND time < ?"
        params: list[object] = [since, until]
        if key_id is not None:
            query += " AND key_id = ?"
            params.append(key_id)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY time", params).fetchall()
        return [dict(row) for row in rows]

    def delete_usage_before(self, moment: float) -> int:
        with self._lock:
            cursor = self._db.execute("DELETE FROM usage_ledger WHERE time < ?", (moment,))
        return cursor.rowcount

    def speed_since(self, minute: int) -> list[tuple[str, int, int, float]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT model, minute, tokens, seconds FROM speed_buckets WHERE minute >= ?", (minute,)
            ).fetchall()
            self._db.execute("DELETE FROM speed_buckets WHERE minute < ?", (minute,))
        return [(r["model"], int(r["minute"]), int(r["tokens"]), float(r["seconds"])) for r in rows]

    def key_by_hash(self, key_hash: str) -> KeyRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()
        return _key(row) if row is not None else None

    def key_by_id(self, key_id: str) -> KeyRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _key(row) if row is not None else None

    def list_keys(self) -> list[KeyRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM api_keys ORDER BY created_at, id").fetchall()
        return [_key(row) for row in rows]

    # Async jobs

    def insert_job(self, tracking_id: str, key_id: str, nonce: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (tracking_id, key_id, status, nonce, created_at) VALUES (?, ?, 'pending', ?, ?)",
                (tracking_id, key_id, nonce, now),
            )

    def finish_job(
        self, tracking_id: str, *, result: str | None, error: str | None, now: float, expires_at: float
    ) -> None:
        status = "ready" if result is not None else "failed"
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, result = ?, error = ?, finished_at = ?, expires_at = ?"
                " WHERE tracking_id = ? AND status = 'pending'",
                (status, result, error, now, expires_at, tracking_id),
            )

    def job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        """The caller's own job, unless it expired; None for anyone else's."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM jobs WHERE tracking_id = ? AND key_id = ? AND (expires_at IS NULL OR expires_at > ?)",
                (tracking_id, key_id, now),
            ).fetchone()
        return _job(row) if row is not None else None

    def claim_job(self, tracking_id: str, key_id: str, now: float) -> JobRecord | None:
        """Atomically take a finished job for one reader: a concurrent poll finds it claimed."""
        with self._lock:
            row = self._db.execute(
                "UPDATE jobs SET status = 'claimed' WHERE tracking_id = ? AND key_id = ?"
                " AND status IN ('ready', 'failed') AND expires_at > ? RETURNING *",
                (tracking_id, key_id, now),
            ).fetchone()
        return _job(row) if row is not None else None

    def release_claim(self, tracking_id: str) -> None:
        """The claimed result did not reach its reader: make it pollable again."""
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END"
                " WHERE tracking_id = ? AND status = 'claimed'",
                (tracking_id,),
            )

    def delete_job(self, tracking_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE tracking_id = ?", (tracking_id,))

    def delete_expired_jobs(self, now: float) -> int:
        with self._lock:
            cursor = self._db.execute("DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))
        return cursor.rowcount

    def fail_interrupted_jobs(self, error: str, now: float, expires_at: float) -> int:
        """At start-up: jobs that were running when the server stopped can never finish (their key is gone)."""
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = CASE WHEN result IS NULL THEN 'failed' ELSE 'ready' END"
                " WHERE status = 'claimed'"
            )
            cursor = self._db.execute(
                "UPDATE jobs SET status = 'failed', error = ?, finished_at = ?, expires_at = ?"
                " WHERE status = 'pending'",
                (error, now, expires_at),
            )
        return cursor.rowcount

    def revoke_key(self, key_id: str) -> bool:
        """Mark a key revoked; False when no active key has that id."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (utc_now(), key_id)
            )
        return cursor.rowcount == 1


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


def _limit_values(limits: KeyLimits) -> tuple[int | None, str | None, int | None, int | None]:
    return (limits.quota_tokens, limits.quota_period, limits.rpm, limits.max_concurrency)


def _key(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        fingerprint=row["fingerprint"],
        is_admin=bool(row["is_admin"]),
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        limits=KeyLimits(row["quota_tokens"], row["quota_period"], row["rpm"], row["max_concurrency"]),
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
