"""The SQLite store on real files: migrations, keys, retention, jobs owned by their gateway."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from llmserver.store import UsageBatch, open_store
from llmserver.store.migrations import MIGRATIONS
from llmserver.store.sqlite import SQLiteStore


def test_migrations_run_once_and_are_recorded(tmp_path: Path) -> None:
    async def scenario() -> None:
        db = tmp_path / "sub" / "x.db"
        store = SQLiteStore(db)
        assert store.schema_version == len(MIGRATIONS)
        await store.insert_key("key_1", "n", "h" * 64, "hhhhhhhh", False)
        await store.close()
        reopened = SQLiteStore(db)  # a second open migrates nothing and keeps the data
        assert reopened.schema_version == len(MIGRATIONS)
        assert [k.id for k in await reopened.list_keys()] == ["key_1"]
        await reopened.close()

    asyncio.run(scenario())


def test_open_store_by_url(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = open_store(f"sqlite:///{tmp_path / 'by-url.db'}")
        assert isinstance(store, SQLiteStore) and store.path == tmp_path / "by-url.db"
        await store.close()

    asyncio.run(scenario())
    for url, problem in (("postgres://x", "not supported"), ("llmserver.db", "must look like"), ("sqlite:///", "path")):
        with pytest.raises(ValueError, match=problem):
            open_store(url)


def test_queries_run_on_the_stores_thread_not_the_event_loop(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SQLiteStore(tmp_path / "x.db")
        # Another connection (the CLI, say) holds the write lock: the store's write waits on its own
        # thread while the event loop keeps running.
        blocker = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        write = asyncio.ensure_future(store.insert_key("key_1", "n", "h" * 64, "hhhhhhhh", False))
        ticks = 0
        while ticks < 20:
            await asyncio.sleep(0.01)
            ticks += 1
        assert not write.done() and ticks == 20
        blocker.execute("ROLLBACK")
        blocker.close()
        assert (await write).id == "key_1"
        assert threading.current_thread() is threading.main_thread()
        await store.close()

    asyncio.run(scenario())


def test_keys_by_hash_and_revocation(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SQLiteStore(tmp_path / "x.db")
        record = await store.insert_key("key_a", "alice", "a" * 64, "aaaaaaaa", True)
        assert record.active and record.is_admin
        assert await store.key_by_hash("a" * 64) == record
        assert await store.key_by_hash("b" * 64) is None
        assert await store.revoke_key("key_a") is True
        assert await store.revoke_key("key_a") is False  # already revoked
        assert await store.revoke_key("key_missing") is False
        revoked = await store.key_by_id("key_a")
        assert revoked is not None and not revoked.active
        await store.close()

    asyncio.run(scenario())


def test_usage_retention(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SQLiteStore(tmp_path / "x.db")
        row = {
            "key_id": "k", "model": "m", "instance_id": None, "endpoint": "/api/generate", "prompt_tokens": 1,
            "completion_tokens": 1, "latency_ms": 1.0, "ttft_ms": None, "tokens_per_second": None, "outcome": "ok",
        }  # fmt: skip
        await store.record(UsageBatch(rows=[{**row, "time": 100.0}, {**row, "time": 200.0}]))
        assert await store.delete_usage_before(150.0) == 1
        assert [r["time"] for r in await store.usage_rows(None, 0, 1000)] == [200.0]
        await store.close()

    asyncio.run(scenario())


def test_interrupted_jobs_are_failed_only_for_their_own_gateway(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SQLiteStore(tmp_path / "x.db")
        await store.insert_job("mine", "k", "n", 1.0, "gw1")
        await store.insert_job("theirs", "k", "n", 1.0, "gw2")
        await store.insert_job("done", "k", "n", 1.0, "gw2")
        await store.finish_job("done", result="ciphertext", error=None, now=2.0, expires_at=10.0)
        claimed = await store.claim_job("done", "k", 3.0, "gw1")  # gw1 was handing it out when it died
        assert claimed is not None and claimed.status == "claimed"
        assert await store.fail_interrupted_jobs("gw1", '{"error": {}}', 5.0, 10.0) == 1
        states = {t: (await store.job(t, "k", 4.0)) for t in ("mine", "theirs", "done")}
        assert {t: j.status for t, j in states.items() if j} == {"mine": "failed", "theirs": "pending", "done": "ready"}
        await store.close()

    asyncio.run(scenario())
