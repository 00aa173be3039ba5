"""When work in flight must end (auth/revocation.py `ended`), from the key's record as it is now; and the
watch that reads each key with work once per sweep and ends that key's work."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from llmserver.auth.keys import Principal
from llmserver.auth.revocation import KeyWatch, ended
from llmserver.errors import APIError
from llmserver.store import KeyRecord

NOW = 1_000_000.0
RECORD = KeyRecord("key_1", "k", "aaaa1111", False, "2026-01-01", None)
PRINCIPAL = Principal("key_1", "k", "aaaa1111", False)


def test_a_key_that_still_stands_goes_on() -> None:
    assert ended(PRINCIPAL, RECORD, NOW) is None
    assert ended(PRINCIPAL, replace(RECORD, expires_at=NOW + 1), NOW) is None


def test_revoked_gone_or_expired_ends_it() -> None:
    assert "was revoked" in ended(PRINCIPAL, replace(RECORD, revoked_at="x"), NOW).message  # type: ignore[union-attr]
    assert "was revoked" in ended(PRINCIPAL, None, NOW).message  # type: ignore[union-attr]
    # the record's expiry, as it is now (moved earlier after the request began)
    error = ended(replace(PRINCIPAL, expires_at=NOW + 999), replace(RECORD, expires_at=NOW - 1), NOW)
    assert error is not None and "expired at" in error.message and error.status == 401


def test_a_rotation_ends_the_old_secret_s_work_with_its_grace() -> None:
    rotated = replace(RECORD, fingerprint="bbbb2222", previous_until=NOW + 10)
    assert ended(PRINCIPAL, rotated, NOW) is None  # in the grace
    assert "rotated" in ended(PRINCIPAL, rotated, NOW + 10).message  # type: ignore[union-attr]
    # work that came with the retired secret during the grace: ends with it, or at a second rotation
    in_grace = replace(PRINCIPAL, fingerprint="bbbb2222", retired_at=NOW + 10)
    assert ended(in_grace, rotated, NOW) is None
    assert ended(in_grace, rotated, NOW + 11) is not None
    assert ended(in_grace, replace(rotated, fingerprint="cccc3333", previous_until=NOW + 99), NOW) is not None
    # the new secret's work goes on
    assert ended(replace(PRINCIPAL, fingerprint="bbbb2222"), rotated, NOW + 99) is None


class Records:
    def __init__(self, record: KeyRecord | None) -> None:
        self.record, self.reads = record, 0

    async def key_by_id(self, key_id: str) -> KeyRecord | None:
        self.reads += 1
        return self.record


def test_the_watch_reads_each_key_once_and_ends_only_its_work() -> None:
    store = Records(replace(RECORD, revoked_at="x"))
    watch = KeyWatch(store, 1.0)  # type: ignore[arg-type]
    ends: list[tuple[str, APIError]] = []
    other = Principal("env-admin", "LLMSERVER_ADMIN_KEY", "ffff", True)
    handles = [watch.track(PRINCIPAL, lambda error, n=n: ends.append((f"stream {n}", error))) for n in range(3)]
    watch.track(other, lambda error: ends.append(("admin", error)))  # the environment's key: not in the store
    watch.untrack(PRINCIPAL, handles[2])  # one already finished
    assert watch.open_work() == 2
    asyncio.run(watch.sweep())
    assert store.reads == 1 and [name for name, _ in ends] == ["stream 0", "stream 1"]
    assert watch.open_work() == 0 and watch.ended == 2
