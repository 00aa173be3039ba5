"""Revocation reaches work in flight (issue 82's fourth row): a stream whose key is revoked (through the API or
with the CLI, as another gateway would), expires or loses its secret to a rotation ends within
`state.key_cache_seconds` plus the time to its next event, with one error event and `[DONE]`; an async job of
such a key is cancelled before it spends the tokens nobody could read.

Before the watch, each of these streams ran to `[DONE]` (issue 82: 20 s after a revocation, 169 s past an
expiry), and the job ran to its end and was charged.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import COUNTING, MODEL, THREADS, Server, cli, make_key, make_key_record, store_rows, wait_for

MAX = 3000  # tokens a stream may run to: ~20 s or more here, so that only its cut ends it early
BOUND = 1.0  # state.key_cache_seconds below: the watch reads keys with work in flight this often
CONFIG = f"""
limits.max_tokens = {MAX}
state.key_cache_seconds = {BOUND}

[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 4096
threads = {THREADS}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(data_dir=tmp_path_factory.mktemp("revocation"), config=CONFIG).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def admin(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_key(server.data_dir, 'revocation-admin', admin=True)}"}


class Stream:
    """A long completion stream read on a thread: its events, and when it ended."""

    def __init__(self, server: Server, key: str) -> None:
        self.events: list[str] = []
        self.ended_at: float | None = None
        self.first = threading.Event()
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": MAX, "stream": True, "temperature": 0}
        self._thread = threading.Thread(target=self._read, args=(server, key, body), daemon=True)
        self._thread.start()
        assert self.first.wait(60), self.events

    def _read(self, server: Server, key: str, body: dict[str, object]) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        self.ended_at = time.monotonic()
        self.first.set()

    def end(self, timeout: float = 60) -> tuple[float, dict[str, object] | None]:
        """Wait for its end: (when, its error event or None)."""
        self._thread.join(timeout)
        assert self.ended_at is not None, "the stream did not end"
        assert self.events[-1] == "[DONE]", self.events[-3:]
        errors = [json.loads(e)["error"] for e in self.events[:-1] if '"error"' in e]
        return self.ended_at, errors[-1] if errors else None

    def tokens(self) -> int:
        return sum(1 for e in self.events[:-1] if '"choices"' in e)


def _cut(stream: Stream, since: float, why: str) -> None:
    ended_at, error = stream.end()
    assert error is not None, stream.events[-3:]
    assert error["type"] == "authentication_error" and why in str(error["message"]), error
    # Within the watch's interval plus an event batch, with room for a busy CI machine: the stream would
    # otherwise run for MAX tokens (tens of seconds here).
    assert ended_at - since < BOUND + 4, ended_at - since
    assert stream.tokens() < MAX * 2 // 3


def test_a_stream_ends_soon_after_its_key_is_revoked_through_the_api(server: Server, admin: dict[str, str]) -> None:
    key_id, key = make_key_record(server.data_dir, "revoked-mid-stream")
    stream = Stream(server, key)
    revoked_at = time.monotonic()
    assert httpx.delete(f"{server.url}/api/keys/{key_id}", headers=admin).status_code == 200
    _cut(stream, revoked_at, "was revoked")


def test_a_stream_ends_soon_after_its_key_is_revoked_with_the_cli(server: Server) -> None:
    """The CLI writes the store and nothing else: as a revocation through another gateway reaches this one."""
    key_id, key = make_key_record(server.data_dir, "revoked-by-cli")
    stream = Stream(server, key)
    done = cli(server.data_dir, "keys", "revoke", key_id)
    assert done.returncode == 0, done.stderr
    _cut(stream, time.monotonic(), "was revoked")


def test_a_stream_ends_when_its_key_expires(server: Server, admin: dict[str, str]) -> None:
    expires_at = time.time() + 3
    made = httpx.post(server.url + "/api/keys", json={"name": "expiring", "expires_at": expires_at}, headers=admin)
    stream = Stream(server, made.json()["key"])
    assert stream.ended_at is None
    _cut(stream, time.monotonic() + max(0.0, expires_at - time.time()), "expired at")


def test_a_stream_on_a_rotated_out_secret_ends_with_its_grace(server: Server, admin: dict[str, str]) -> None:
    key_id, old = make_key_record(server.data_dir, "rotating-mid-stream")
    stream = Stream(server, old)
    rotated = httpx.post(f"{server.url}/api/keys/{key_id}/rotate", params={"grace_seconds": 2}, headers=admin)
    assert rotated.status_code == 200
    grace_over = time.monotonic() + 2
    new_stream = Stream(server, rotated.json()["key"])  # the new secret's work goes on
    _cut(stream, grace_over, "rotated")
    assert new_stream.ended_at is None
    new_key = rotated.json()["key"]
    assert (
        httpx.post(f"{server.url}/api/keys/{key_id}/rotate", params={"grace_seconds": 0}, headers=admin).status_code
        == 200
    )  # and a second rotation with no grace ends it too
    _cut(new_stream, time.monotonic(), "rotated")
    assert new_key


def test_an_async_job_of_a_revoked_key_is_cancelled_before_it_spends_its_tokens(
    server: Server, admin: dict[str, str]
) -> None:
    key_id, key = make_key_record(server.data_dir, "revoked-job")
    body = {
        "model": MODEL, "prompt": COUNTING, "raw": True, "max_tokens": MAX, "temperature": 0, "mode": "async",
        "key": base64.b64encode(os.urandom(32)).decode(),
    }  # fmt: skip
    submitted = httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"})
    assert submitted.status_code == 200, submitted.text
    tracking_id = submitted.json()["tracking_id"]
    query = "SELECT status, error FROM jobs WHERE tracking_id = ?"
    assert wait_for(lambda: busy(server, admin) > 0, 30)  # generating
    revoked_at = time.monotonic()
    assert httpx.delete(f"{server.url}/api/keys/{key_id}", headers=admin).status_code == 200
    assert wait_for(lambda: store_rows(server.data_dir, query, tracking_id)[0]["status"] == "failed", 10)
    assert time.monotonic() - revoked_at < BOUND + 4
    error = json.loads(store_rows(server.data_dir, query, tracking_id)[0]["error"])["error"]
    assert error["type"] == "authentication_error" and "was revoked" in error["message"]
    assert wait_for(lambda: store_rows(server.data_dir, "SELECT 1 FROM usage_ledger WHERE key_id = ?", key_id), 10)
    rows = store_rows(server.data_dir, "SELECT completion_tokens FROM usage_ledger WHERE key_id = ?", key_id)
    assert rows and rows[0]["completion_tokens"] < MAX * 2 // 3, rows


def busy(server: Server, admin: dict[str, str]) -> int:
    instances = httpx.get(server.url + "/api/instances", headers=admin).json()["data"]
    return sum(int(i["active_users"]) for i in instances)
