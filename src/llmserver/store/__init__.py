"""Persistent state behind a small interface; SQLite is the embedded default."""

from llmserver.store.sqlite import NO_LIMITS, JobRecord, KeyLimits, KeyRecord, SQLiteStore

__all__ = ["NO_LIMITS", "JobRecord", "KeyLimits", "KeyRecord", "SQLiteStore"]
