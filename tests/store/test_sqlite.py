"""The SQLite store on real files: migrations, keys, retention, jobs owned by their gateway."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from llmserver.store import SchemaError, open_store
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
        store = await open_store(f"sqlite:///{tmp_path / 'by-url.db'}")
        assert isinstance(store, SQLiteStore) and store.path == tmp_path / "by-url.db"
        await store.close()
        bad = (("mysql://x", "not supported"), ("llmserver.db", "must look like"), ("sqlite:///", "path"))
        for url, problem in bad:
            with pytest.raises(ValueError, match=problem):
                await open_store(url)

    asyncio.run(scenario())


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SQLiteStore(tmp_path / "x.db")
        await store.close()
        db = sqlite3.connect(tmp_path / "x.db")
        db.execute("INSERT INTO schema_migrations (version) VALUES (?)", (len(MIGRATIONS) + 1,))
        db.commit()
        db.close()
        with pytest.raises(SchemaError, match="newer than this llmserver knows"):
            SQLiteStore(tmp_path / "x.db")

    asyncio.run(scenario())


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
