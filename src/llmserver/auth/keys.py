"""API keys: generation, hashing, verification.

A key is shown once, at creation; the store keeps only its SHA-256. Logs name a key by its
fingerprint (the first 8 hex digits of the hash), never by the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from llmserver.errors import AuthenticationError
from llmserver.store import KeyRecord, SQLiteStore

KEY_PREFIX = "llms-"
ADMIN_ENV_KEY_ID = "env-admin"


@dataclass(frozen=True)
class Principal:
    """The caller a request was authenticated as."""

    key_id: str
    name: str
    fingerprint: str
    is_admin: bool


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def fingerprint(key_hash: str) -> str:
    return key_hash[:8]


class KeyService:
    def __init__(self, store: SQLiteStore, admin_key: str | None = None) -> None:
        self._store = store
        self._admin_hash = hash_key(admin_key) if admin_key else None

    def create(self, name: str, *, admin: bool = False) -> tuple[KeyRecord, str]:
        """A new key: its record, and the key itself, which is never stored."""
        if not name.strip():
            raise ValueError("a key needs a non-empty name")
        key = generate_key()
        key_hash = hash_key(key)
        record = self._store.insert_key(
            key_id="key_" + secrets.token_hex(6),
            name=name.strip(),
            key_hash=key_hash,
            fingerprint=fingerprint(key_hash),
            is_admin=admin,
        )
        return record, key

    def list(self) -> list[KeyRecord]:
        return self._store.list_keys()

    def revoke(self, key_id: str) -> bool:
        return self._store.revoke_key(key_id)

    def authenticate(self, presented: str | None) -> Principal:
        """The principal for a presented key; AuthenticationError when missing, unknown or revoked."""
        if not presented:
            raise AuthenticationError()
        key_hash = hash_key(presented)
        if self._admin_hash is not None and hmac.compare_digest(key_hash, self._admin_hash):
            return Principal(ADMIN_ENV_KEY_ID, "LLMSERVER_ADMIN_KEY", fingerprint(key_hash), True)
        record = self._store.key_by_hash(key_hash)
        if record is None or not record.active:
            raise AuthenticationError()
        return Principal(record.id, record.name, record.fingerprint, record.is_admin)
