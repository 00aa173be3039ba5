"""Persistent state behind named interfaces (`interfaces.py`); the engine is chosen by `database_url`.

`sqlite:///PATH` (the default: the file in the data dir) is the embedded engine. Engines are
imported only when chosen.
"""

from __future__ import annotations

from pathlib import Path

from llmserver.store.interfaces import (
    NO_LIMITS,
    JobRecord,
    JobStore,
    KeyLimits,
    KeyRecord,
    KeyStore,
    QuotaGrant,
    QuotaStore,
    Settlement,
    Store,
    UsageBatch,
    UsageStore,
)

__all__ = [
    "NO_LIMITS",
    "JobRecord",
    "JobStore",
    "KeyLimits",
    "KeyRecord",
    "KeyStore",
    "QuotaGrant",
    "QuotaStore",
    "Settlement",
    "Store",
    "UsageBatch",
    "UsageStore",
    "open_store",
]


def open_store(database_url: str) -> Store:
    """The store a database URL names; ValueError for a scheme this build has no engine for."""
    scheme, sep, rest = database_url.partition("://")
    if not sep:
        raise ValueError(f"database_url must look like sqlite:///PATH, not {database_url!r}")
    if scheme == "sqlite":
        from llmserver.store.sqlite import SQLiteStore

        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        path = rest[1:] if rest.startswith("/") else rest
        if not path:
            raise ValueError("database_url sqlite:/// needs a file path")
        return SQLiteStore(Path(path))
    raise ValueError(f"database_url scheme {scheme!r} is not supported; this build has: sqlite")
