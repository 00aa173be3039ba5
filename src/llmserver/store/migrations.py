"""Ordered schema migrations for each engine. Append new ones; never edit one that has shipped.

SQLite's list is the embedded store's history since the first release; PostgreSQL's starts at the
schema SQLite had reached when PostgreSQL support arrived (its version numbers are its own).
"""

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
    # 3: quotas and limits per key, quota counters per period, the usage ledger, per-minute speed.
    """
    ALTER TABLE api_keys ADD COLUMN quota_tokens INTEGER;
    ALTER TABLE api_keys ADD COLUMN quota_period TEXT;
    ALTER TABLE api_keys ADD COLUMN rpm INTEGER;
    ALTER TABLE api_keys ADD COLUMN max_concurrency INTEGER;
    CREATE TABLE quota_usage (
        key_id       TEXT NOT NULL,
        period_start TEXT NOT NULL,
        used         INTEGER NOT NULL DEFAULT 0,
        reserved     INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (key_id, period_start)
    );
    CREATE TABLE usage_ledger (
        id                INTEGER PRIMARY KEY,
        time              REAL NOT NULL,
        key_id            TEXT NOT NULL,
        model             TEXT NOT NULL,
        instance_id       TEXT,
        endpoint          TEXT NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        latency_ms        REAL NOT NULL,
        ttft_ms           REAL,
        tokens_per_second REAL,
        outcome           TEXT NOT NULL
    );
    CREATE INDEX usage_by_key_time ON usage_ledger (key_id, time);
    CREATE INDEX usage_by_time ON usage_ledger (time);
    CREATE TABLE speed_buckets (
        model   TEXT NOT NULL,
        minute  INTEGER NOT NULL,
        tokens  INTEGER NOT NULL,
        seconds REAL NOT NULL,
        PRIMARY KEY (model, minute)
    );
    """,
    # 4: state that names its gateway. A quota reservation is held per (key, window, gateway), so that
    # a gateway clears only its own at start-up; a job records the gateway that runs it (its key lives
    # only in that process) and the one that claimed its result. Jobs pending before this migration
    # were interrupted: failed.
    """
    CREATE TABLE quota_reservations (
        key_id       TEXT NOT NULL,
        period_start TEXT NOT NULL,
        gateway_id   TEXT NOT NULL,
        amount       INTEGER NOT NULL,
        PRIMARY KEY (key_id, period_start, gateway_id)
    );
    CREATE INDEX quota_reservations_by_gateway ON quota_reservations (gateway_id);
    ALTER TABLE quota_usage DROP COLUMN reserved;
    ALTER TABLE jobs ADD COLUMN gateway_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE jobs ADD COLUMN claimed_by TEXT;
    CREATE INDEX jobs_by_gateway ON jobs (gateway_id, status);
    UPDATE jobs SET status = 'failed',
        error = '{"error": {"message": "The server restarted while this job was running: submit it again.",'
                || ' "type": "server_error", "code": 500}}',
        finished_at = created_at, expires_at = created_at + 3600
        WHERE status = 'pending';
    """,
    # 5: which models a key may use (a JSON list of names or patterns; NULL: all).
    """
    ALTER TABLE api_keys ADD COLUMN models TEXT;
    """,
    # 6: gateway leases (a lapsed one is swept by another gateway), what each reservation's requests
    # have produced so far (what a sweep charges), and the webhook outbox.
    """
    CREATE TABLE gateways (
        id          TEXT PRIMARY KEY,
        host        TEXT NOT NULL,
        pid         INTEGER NOT NULL,
        started_at  REAL NOT NULL,
        lease_until REAL NOT NULL
    );
    ALTER TABLE quota_reservations ADD COLUMN produced INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE webhook_outbox (
        id            INTEGER PRIMARY KEY,
        tracking_id   TEXT NOT NULL,
        url           TEXT NOT NULL,
        payload       TEXT NOT NULL,
        attempts      INTEGER NOT NULL DEFAULT 0,
        next_at       REAL NOT NULL,
        claimed_by    TEXT,
        claimed_until REAL
    );
    CREATE INDEX webhook_outbox_due ON webhook_outbox (next_at);
    """,
    # 7: the webhook URL of a pending job, so that a sweep that fails the job (its gateway died) can
    # still tell the client through its webhook.
    """
    ALTER TABLE jobs ADD COLUMN webhook_url TEXT;
    """,
    # 8: the model catalog (each model's settings as JSON, where they came from, a revision that
    # counts its changes) and named leases (the scheduler's leader).
    """
    CREATE TABLE models (
        name       TEXT PRIMARY KEY,
        config     TEXT NOT NULL,
        origin     TEXT NOT NULL,
        revision   INTEGER NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE leases (
        name        TEXT PRIMARY KEY,
        holder      TEXT NOT NULL,
        lease_until REAL NOT NULL
    );
    """,
    # 9: operators' marks on worker nodes (cordoned, draining), which the scheduler reads.
    """
    CREATE TABLE node_marks (
        node  TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        since REAL NOT NULL
    );
    """,
    # 10: the audit log: one row per admin action through the API, appended, never changed (swept
    # by `state.audit_retention_days`).
    """
    CREATE TABLE audit_log (
        id         INTEGER PRIMARY KEY,
        time       REAL NOT NULL,
        key_id     TEXT NOT NULL,
        key_name   TEXT NOT NULL,
        action     TEXT NOT NULL,
        target     TEXT,
        change     TEXT,
        status     INTEGER NOT NULL,
        client     TEXT,
        request_id TEXT
    );
    CREATE INDEX audit_by_time ON audit_log (time);
    """,
    # 11: keys that expire and rotate: when a key stops being accepted, when it was last used (written
    # in batches), and the secret a rotation replaced, accepted until the end of its grace period.
    """
    ALTER TABLE api_keys ADD COLUMN expires_at REAL;
    ALTER TABLE api_keys ADD COLUMN last_used_at REAL;
    ALTER TABLE api_keys ADD COLUMN previous_hash TEXT;
    ALTER TABLE api_keys ADD COLUMN previous_until REAL;
    CREATE INDEX api_keys_by_previous_hash ON api_keys (previous_hash);
    """,
    # 12: what each request cost, at its model's prices of the time (NULL: the model had none).
    """
    ALTER TABLE usage_ledger ADD COLUMN cost REAL;
    """,
    # 13: teams: keys that share limits (a member's requests fit both its own and its team's). A team's
    # token quota is counted in quota_usage and quota_reservations under the team's id, as a key's is.
    """
    CREATE TABLE teams (
        id              TEXT PRIMARY KEY,
        name            TEXT NOT NULL UNIQUE,
        created_at      TEXT NOT NULL,
        quota_tokens    INTEGER,
        quota_period    TEXT,
        rpm             INTEGER,
        max_concurrency INTEGER,
        models          TEXT
    );
    ALTER TABLE api_keys ADD COLUMN team_id TEXT REFERENCES teams (id) ON DELETE SET NULL;
    CREATE INDEX api_keys_by_team ON api_keys (team_id);
    """,
    # 14: team admin keys: a key of a team that manages its team's keys (and nothing else).
    """
    ALTER TABLE api_keys ADD COLUMN is_team_admin INTEGER NOT NULL DEFAULT 0;
    """,
    # 15: budgets in money (in billing.currency) per period, of keys and of teams. Their counters are rows
    # of quota_usage and quota_reservations under the id with "/money" after it, in billionths.
    """
    ALTER TABLE api_keys ADD COLUMN budget REAL;
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT;
    ALTER TABLE teams ADD COLUMN budget REAL;
    ALTER TABLE teams ADD COLUMN budget_period TEXT;
    """,
]

POSTGRES: list[str] = [
    # 1: everything SQLite's migrations 1-6 built, in PostgreSQL's types.
    """
    CREATE TABLE api_keys (
        id              TEXT PRIMARY KEY,
        name            TEXT NOT NULL,
        key_hash        TEXT NOT NULL UNIQUE,
        fingerprint     TEXT NOT NULL,
        is_admin        BOOLEAN NOT NULL DEFAULT FALSE,
        created_at      TEXT NOT NULL,
        revoked_at      TEXT,
        quota_tokens    BIGINT,
        quota_period    TEXT,
        rpm             INTEGER,
        max_concurrency INTEGER,
        models          TEXT
    );
    CREATE TABLE jobs (
        tracking_id TEXT PRIMARY KEY,
        key_id      TEXT NOT NULL,
        status      TEXT NOT NULL,
        nonce       TEXT NOT NULL,
        result      TEXT,
        error       TEXT,
        created_at  DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION,
        expires_at  DOUBLE PRECISION,
        gateway_id  TEXT NOT NULL DEFAULT '',
        claimed_by  TEXT
    );
    CREATE INDEX jobs_by_expiry ON jobs (expires_at);
    CREATE INDEX jobs_by_gateway ON jobs (gateway_id, status);
    CREATE TABLE quota_usage (
        key_id       TEXT NOT NULL,
        period_start TEXT NOT NULL,
        used         BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (key_id, period_start)
    );
    CREATE TABLE quota_reservations (
        key_id       TEXT NOT NULL,
        period_start TEXT NOT NULL,
        gateway_id   TEXT NOT NULL,
        amount       BIGINT NOT NULL,
        produced     BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (key_id, period_start, gateway_id)
    );
    CREATE INDEX quota_reservations_by_gateway ON quota_reservations (gateway_id);
    CREATE TABLE usage_ledger (
        id                BIGSERIAL PRIMARY KEY,
        time              DOUBLE PRECISION NOT NULL,
        key_id            TEXT NOT NULL,
        model             TEXT NOT NULL,
        instance_id       TEXT,
        endpoint          TEXT NOT NULL,
        prompt_tokens     BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        latency_ms        DOUBLE PRECISION NOT NULL,
        ttft_ms           DOUBLE PRECISION,
        tokens_per_second DOUBLE PRECISION,
        outcome           TEXT NOT NULL
    );
    CREATE INDEX usage_by_key_time ON usage_ledger (key_id, time);
    CREATE INDEX usage_by_time ON usage_ledger (time);
    CREATE TABLE speed_buckets (
        model   TEXT NOT NULL,
        minute  BIGINT NOT NULL,
        tokens  BIGINT NOT NULL,
        seconds DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (model, minute)
    );
    CREATE TABLE gateways (
        id          TEXT PRIMARY KEY,
        host        TEXT NOT NULL,
        pid         INTEGER NOT NULL,
        started_at  DOUBLE PRECISION NOT NULL,
        lease_until DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE webhook_outbox (
        id            BIGSERIAL PRIMARY KEY,
        tracking_id   TEXT NOT NULL,
        url           TEXT NOT NULL,
        payload       TEXT NOT NULL,
        attempts      INTEGER NOT NULL DEFAULT 0,
        next_at       DOUBLE PRECISION NOT NULL,
        claimed_by    TEXT,
        claimed_until DOUBLE PRECISION
    );
    CREATE INDEX webhook_outbox_due ON webhook_outbox (next_at);
    """,
    # 2: as SQLite's 7: a pending job's webhook URL, for the sweep's failure webhook.
    """
    ALTER TABLE jobs ADD COLUMN webhook_url TEXT;
    """,
    # 3: as SQLite's 8: the model catalog and named leases.
    """
    CREATE TABLE models (
        name       TEXT PRIMARY KEY,
        config     TEXT NOT NULL,
        origin     TEXT NOT NULL,
        revision   INTEGER NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE leases (
        name        TEXT PRIMARY KEY,
        holder      TEXT NOT NULL,
        lease_until DOUBLE PRECISION NOT NULL
    );
    """,
    # 4: as SQLite's 9: operators' marks on worker nodes.
    """
    CREATE TABLE node_marks (
        node  TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        since DOUBLE PRECISION NOT NULL
    );
    """,
    # 5: as SQLite's 10: the audit log.
    """
    CREATE TABLE audit_log (
        id         BIGSERIAL PRIMARY KEY,
        time       DOUBLE PRECISION NOT NULL,
        key_id     TEXT NOT NULL,
        key_name   TEXT NOT NULL,
        action     TEXT NOT NULL,
        target     TEXT,
        change     TEXT,
        status     INTEGER NOT NULL,
        client     TEXT,
        request_id TEXT
    );
    CREATE INDEX audit_by_time ON audit_log (time);
    """,
    # 6: as SQLite's 11: keys that expire and rotate, and when each was last used.
    """
    ALTER TABLE api_keys ADD COLUMN expires_at DOUBLE PRECISION;
    ALTER TABLE api_keys ADD COLUMN last_used_at DOUBLE PRECISION;
    ALTER TABLE api_keys ADD COLUMN previous_hash TEXT;
    ALTER TABLE api_keys ADD COLUMN previous_until DOUBLE PRECISION;
    CREATE INDEX api_keys_by_previous_hash ON api_keys (previous_hash);
    """,
    # 7: as SQLite's 12: each request's cost.
    """
    ALTER TABLE usage_ledger ADD COLUMN cost DOUBLE PRECISION;
    """,
    # 8: as SQLite's 13: teams.
    """
    CREATE TABLE teams (
        id              TEXT PRIMARY KEY,
        name            TEXT NOT NULL UNIQUE,
        created_at      TEXT NOT NULL,
        quota_tokens    BIGINT,
        quota_period    TEXT,
        rpm             INTEGER,
        max_concurrency INTEGER,
        models          TEXT
    );
    ALTER TABLE api_keys ADD COLUMN team_id TEXT REFERENCES teams (id) ON DELETE SET NULL;
    CREATE INDEX api_keys_by_team ON api_keys (team_id);
    """,
    # 9: as SQLite's 14: team admin keys.
    """
    ALTER TABLE api_keys ADD COLUMN is_team_admin BOOLEAN NOT NULL DEFAULT FALSE;
    """,
    # 10: as SQLite's 15: budgets in money.
    """
    ALTER TABLE api_keys ADD COLUMN budget DOUBLE PRECISION;
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT;
    ALTER TABLE teams ADD COLUMN budget DOUBLE PRECISION;
    ALTER TABLE teams ADD COLUMN budget_period TEXT;
    """,
]
