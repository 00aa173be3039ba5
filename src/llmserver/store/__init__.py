"""Persistent state behind named interfaces (`interfaces.py`); the engine is chosen by `database_url`.

`sqlite:///PATH` (the default: the file in the data dir) is the embedded engine, migrated when it is
opened; `postgresql://…` is the engine many gateways share, migrated only by `llmserver db migrate`
(a gateway refuses to start on a schema it does not know). Engines are imported only when chosen.
"""

from __future__ import annotations

from pathlib import Path

from llmserver.store.interfaces import (
    AUDIT_COLUMNS,
    NO_LIMITS,
    STATUSES,
    Alert,
    AuditQuery,
    AuditStore,
    CatalogEntry,
    CatalogStore,
    GatewayHolder,
    GatewayStore,
    JobRecord,
    JobStore,
    KeyLimits,
    KeyRecord,
    KeyStore,
    LedgerQuery,
    NodeMark,
    OutboxItem,
    OutboxStore,
    QuotaGrant,
    QuotaStore,
    SchemaError,
    Settlement,
    Store,
    Sweep,
    TeamRecord,
    TeamStore,
    UsageBatch,
    UsageStore,
)
from llmserver.store.rows import redact

__all__ = [
    "AUDIT_COLUMNS",
    "NO_LIMITS",
    "STATUSES",
    "Alert",
    "AuditQuery",
    "AuditStore",
    "CatalogEntry",
    "CatalogStore",
    "GatewayHolder",
    "GatewayStore",
    "JobRecord",
    "JobStore",
    "KeyLimits",
    "KeyRecord",
    "KeyStore",
    "LedgerQuery",
    "NodeMark",
    "OutboxItem",
    "OutboxStore",
    "QuotaGrant",
    "QuotaStore",
    "SchemaError",
    "Settlement",
    "Store",
    "Sweep",
    "TeamRecord",
    "TeamStore",
    "UsageBatch",
    "UsageStore",
    "open_store",
    "redact",
]


POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_postgres(database_url: str) -> bool:
    return database_url.partition("://")[0] in POSTGRES_SCHEMES


async def open_store(database_url: str, *, migrate: bool = False) -> Store:
    """The store a database URL names; ValueError for a scheme this build has no engine for, SchemaError
    for a schema it does not know (PostgreSQL's is migrated first with `migrate`)."""
    scheme, sep, rest = database_url.partition("://")
    if not sep:
        raise ValueError(f"database_url must look like sqlite:///PATH or postgresql://…, not {database_url!r}")
    if scheme == "sqlite":
        from llmserver.store.sqlite import SQLiteStore

        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        path = rest[1:] if rest.startswith("/") else rest
        if not path:
            raise ValueError("database_url sqlite:/// needs a file path")
        return SQLiteStore(Path(path))
    if scheme in POSTGRES_SCHEMES:
        from llmserver.store.postgres import PostgresStore

        return await PostgresStore.connect(database_url, migrate=migrate)
    raise ValueError(f"database_url scheme {scheme!r} is not supported; this build has: sqlite, postgresql")
