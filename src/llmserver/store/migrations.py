"""Ordered schema migrations. Append new ones; never edit one that has shipped."""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: API keys, stored by SHA-256 hash only.
    """
    CREATE TABLE api_keys (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        key_hash    TEXT NOT NULL UNIQUE,
        fingerprint TEXT NOT NULL,
        is_admin    INTEGER NOT NULL DEFAULT 0,
        created_at  TEXT NOT NULL,
        revoked_at  TEXT
    );
    """,
]
