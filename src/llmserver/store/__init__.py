"""Persistent state behind a small interface; SQLite is the embedded default."""

from llmserver.store.sqlite import JobRecord, KeyRecord, SQLiteStore

__all__ = ["JobRecord", "KeyRecord", "SQLiteStore"]
