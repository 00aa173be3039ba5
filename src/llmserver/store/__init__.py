"""Persistent state behind a small interface; SQLite is the embedded default."""

from llmserver.store.sqlite import KeyRecord, SQLiteStore

__all__ = ["KeyRecord", "SQLiteStore"]
