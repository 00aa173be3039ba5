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
    # 2: async jobs. Never the client's key or a plaintext: only the ciphertext and the nonce.
    """
    CREATE TABLE jobs (
        tracking_id TEXT PRIMARY KEY,
        key_id      TEXT NOT NULL,
        status      TEXT NOT NULL,
        nonce       TEXT NOT NULL,
        result      TEXT,
        error       TEXT,
        created_at  REAL NOT NULL,
        finished_at REAL,
        expires_at  REAL
    );
    CREATE INDEX jobs_by_expiry ON jobs (expires_at);
    """,
]
