from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserver.auth.keys import KEY_PREFIX, KeyService, hash_key
from llmserver.errors import AuthenticationError
from llmserver.store.sqlite import SQLiteStore

run = asyncio.run


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / "keys.db")
    yield opened
    run(opened.close())


def test_created_key_authenticates_and_is_stored_only_as_hash(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "keys.db")
    service = KeyService(store)
    record, key = run(service.create("alice"))
    assert key.startswith(KEY_PREFIX) and len(key) > 40
    principal = run(service.authenticate(key))
    assert (principal.key_id, principal.name, principal.is_admin) == (record.id, "alice", False)
    assert principal.fingerprint == hash_key(key)[:8]
    run(store.close())
    raw = store.path.read_bytes() + (
        store.path.with_name(store.path.name + "-wal").read_bytes()
        if store.path.with_name(store.path.name + "-wal").exists()
        else b""
    )
    assert key.encode() not in raw
    assert hash_key(key).encode() in raw


@pytest.mark.parametrize("presented", [None, "", "llms-not-a-key", "Bearer x"])
def test_unknown_keys_are_rejected(store: SQLiteStore, presented: str | None) -> None:
    run(KeyService(store).create("someone"))
    with pytest.raises(AuthenticationError) as caught:
        run(KeyService(store).authenticate(presented))
    assert caught.value.body() == {"error": {"message": "Invalid API key", "type": "authentication_error", "code": 401}}


def test_revoked_key_is_rejected_at_once(store: SQLiteStore) -> None:
    service = KeyService(store)
    record, key = run(service.create("bob", admin=True))
    assert run(service.authenticate(key)).is_admin
    # A second service on the same file (as the CLI is to the server) sees the revocation.
    other = SQLiteStore(store.path)
    assert run(KeyService(other).revoke(record.id))
    run(other.close())
    with pytest.raises(AuthenticationError):
        run(service.authenticate(key))


def test_environment_admin_key(store: SQLiteStore) -> None:
    service = KeyService(store, admin_key="env-secret-key")
    principal = run(service.authenticate("env-secret-key"))
    assert principal.is_admin and principal.key_id == "env-admin"
    with pytest.raises(AuthenticationError):
        run(service.authenticate("env-secret-key-2"))


def test_empty_name_is_refused(store: SQLiteStore) -> None:
    with pytest.raises(ValueError):
        run(KeyService(store).create("  "))
