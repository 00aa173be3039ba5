"""Records from database rows, shared by the engines (a sqlite3.Row and an asyncpg.Record both map names)."""

from __future__ import annotations

import json
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from llmserver.store.interfaces import JobRecord, KeyLimits, KeyRecord, TeamRecord


class Row(Protocol):
    def __getitem__(self, name: str) -> Any: ...


# The limit columns of api_keys and of teams, in limit_values' order.
LIMIT_COLUMNS = ("quota_tokens", "quota_period", "rpm", "max_concurrency", "models", "budget", "budget_period")


def limit_marks(first: int | None = None) -> str:
    """Their placeholders: `?` each (SQLite), or `$first`, `$first+1`, … (PostgreSQL)."""
    return ", ".join("?" if first is None else f"${first + i}" for i in range(len(LIMIT_COLUMNS)))


def limit_sets(first: int | None = None) -> str:
    """`column = placeholder` for each, to UPDATE them."""
    marks = limit_marks(first).split(", ")
    return ", ".join(f"{column} = {mark}" for column, mark in zip(LIMIT_COLUMNS, marks, strict=True))


def limit_values(limits: KeyLimits) -> tuple[object, ...]:
    """The columns quota_tokens, quota_period, rpm, max_concurrency, models, budget, budget_period (of
    api_keys and of teams)."""
    models = json.dumps(list(limits.models)) if limits.models is not None else None
    return (
        limits.quota_tokens, limits.quota_period, limits.rpm, limits.max_concurrency, models, limits.budget,
        limits.budget_period,
    )  # fmt: skip


def _limits(row: Row) -> KeyLimits:
    """The limit columns keys and teams share."""
    models = tuple(json.loads(row["models"])) if row["models"] is not None else None
    return KeyLimits(
        row["quota_tokens"], row["quota_period"], row["rpm"], row["max_concurrency"], models, row["budget"],
        row["budget_period"],
    )  # fmt: skip


def key_record(row: Row) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        fingerprint=row["fingerprint"],
        is_admin=bool(row["is_admin"]),
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        limits=_limits(row),
        expires_at=row["expires_at"],
        last_used_at=row["last_used_at"],
        previous_until=row["previous_until"],
        team_id=row["team_id"],
        team_admin=bool(row["is_team_admin"]),
    )


def team_record(row: Row) -> TeamRecord:
    return TeamRecord(id=row["id"], name=row["name"], created_at=row["created_at"], limits=_limits(row))


def job_record(row: Row) -> JobRecord:
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


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
