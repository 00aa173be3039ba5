from __future__ import annotations

from pathlib import Path

from llmserver.store import SQLiteStore
from llmserver.store.migrations import MIGRATIONS


def test_migrations_run_once_and_are_recorded(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "x.db"
    store = SQLiteStore(db)
    assert store.schema_version == len(MIGRATIONS)
    store.insert_key("key_1", "n", "h" * 64, "hhhhhhhh", False)
    store.close()
    reopened = SQLiteStore(db)  # a second open migrates nothing and keeps the data
    assert reopened.schema_version == len(MIGRATIONS)
    assert [k.id for k in reopened.list_keys()] == ["key_1"]


def test_keys_by_hash_and_revocation(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    record = store.insert_key("key_a", "alice", "a" * 64, "aaaaaaaa", True)
    assert record.active and record.is_admin
    assert store.key_by_hash("a" * 64) == record
    assert store.key_by_hash("b" * 64) is None
    assert store.revoke_key("key_a") is True
    assert store.revoke_key("key_a") is False  # already revoked
    assert store.revoke_key("key_missing") is False
    revoked = store.key_by_id("key_a")
    assert revoked is not None and not revoked.active


def test_usage_retention(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.db")
    row = {
        "key_id": "k", "model": "m", "instance_id": None, "endpoint": "/api/generate", "prompt_tokens": 1,
        "completion_tokens": 1, "latency_ms": 1.0, "ttft_ms": None, "tokens_per_second": None, "outcome": "ok",
    }  # fmt: skip
    store.record_usage_and_speed([{**row, "time": 100.0}, {**row, "time": 200.0}], [])
    assert store.delete_usage_before(150.0) == 1
    assert [r["time"] for r in store.usage_rows(None, 0, 1000)] == [200.0]
