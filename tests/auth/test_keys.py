from __future__ import annotations

from pathlib import Path

import pytest

from llmserver.auth.keys import KEY_PREFIX, KeyService, hash_key
from llmserver.errors import AuthenticationError
from llmserver.store import SQLiteStore


@pytest.fixture
def store(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(tmp_path / "keys.db")


def test_created_key_authenticates_and_is_stored_only_as_hash(store: SQLiteStore) -> None:
    service = KeyService(store)
    record, key = service.create("alice")
    assert key.startswith(KEY_PREFIX) and len(key) > 40
    principal = service.authenticate(key)
    assert (principal.key_id, principal.name, principal.is_admin) == (record.id, "alice", False)
    assert principal.fingerprint == hash_key(key)[:8]
    store.close()
    raw = store.path.read_bytes() + (
        store.path.with_name(store.path.name + "-wal").read_bytes()
        if store.path.with_name(store.path.name + "-wal").exists()
        else b""
    )
    assert key.encode() not in raw
    assert hash_key(key).encode() in raw


@pytest.mark.parametrize("presented", [None, "", "llms-not-a-key", "Bearer x"])
def test_unknown_keys_are_rejected(store: SQLiteStore, presented: str | None) -> None:
    KeyService(store).create("someone")
    with pytest.raises(AuthenticationError) as caught:
        KeyService(store).authenticate(presented)
    assert caught.value.body() == {"error": {"message": "Invalid API key", "type": "authentication_error", "code": 401}}


def test_revoked_key_is_rejected_at_once(store: SQLiteStore) -> None:
    service = KeyService(store)
    record, key = service.create("bob", admin=True)
    assert service.authenticate(key).is_admin
    # A second service on the same file (as the CLI is to the server) sees the revocation.
    assert KeyService(SQLiteStore(store.path)).revoke(record.id)
    with pytest.raises(AuthenticationError):
        service.authenticate(key)


def test_environment_admin_key(store: SQLiteStore) -> None:
    service = KeyService(store, admin_key="env-secret-key")
    principal = service.authenticate("env-secret-key")
    assert principal.is_admin and principal.key_id == "env-admin"
    with pytest.raises(AuthenticationError):
        service.authenticate("env-secret-key-2")


def test_empty_name_is_refused(store: SQLiteStore) -> None:
    with pytest.raises(ValueError):
        KeyService(store).create("  ")
