"""Revocation that reaches work in flight: a key revoked, expired, or whose secret a rotation's grace let go,
ends the streams and async jobs it already started, not only the requests it makes next.

The engine and the job service register each stream and each async job with the key it runs under
(`KeyWatch.track`) and hand it a way to end it. Every `interval` seconds (`state.key_cache_seconds`, the bound
a new request's key check already has across gateways) the watch reads the record of each key that has work in
flight here — one read per key, not per request — and ends that key's work when the key no longer stands:

- revoked (here, through another gateway, or with the CLI);
- past its expiry (as the record now has it: an expiry moved earlier counts);
- its work authenticated with a secret that a rotation retired, once the grace is over (or at once when a
  later rotation replaced that secret too).

A stream ends at its next event batch — a token, or a progress event while the prompt is read — with one
error event (`authentication_error`, saying which of the three) and its end; an async job is cancelled and
fails with the same error, before it spends tokens nobody could read (its poll would answer 401). So the
bound is `interval` plus the time to the stream's next event.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import time
from collections.abc import Callable

from llmserver.auth.keys import ADMIN_ENV_KEY_ID, Principal
from llmserver.errors import APIError, AuthenticationError
from llmserver.logs import request_id
from llmserver.store import KeyRecord, KeyStore

log = logging.getLogger(__name__)

End = Callable[[APIError], None]
MIN_INTERVAL = 0.25  # seconds between reads when key_cache_seconds is 0 (every request reads the store)


class KeyEnded(AuthenticationError):
    """The key a request in flight runs under stopped standing while it ran."""

    def __init__(self, why: str) -> None:
        APIError.__init__(self, f"This API key {why} while the request ran: it was ended.")


def _utc(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ended(principal: Principal, record: KeyRecord | None, now: float) -> KeyEnded | None:
    """Why work authenticated as `principal` may not go on, given its key's record now; None: it may."""
    if record is None or not record.active:
        return KeyEnded("was revoked")
    if record.expires_at is not None and now >= record.expires_at:
        return KeyEnded(f"expired at {_utc(record.expires_at)}")
    rotated_since = record.fingerprint != principal.fingerprint
    if principal.retired_at is not None:  # it came with a secret already rotated out, in its grace
        if rotated_since or now >= min(principal.retired_at, record.previous_until or 0.0):
            return KeyEnded("was rotated and the grace of the secret it used is over")
    elif rotated_since and now >= (record.previous_until or 0.0):
        return KeyEnded("was rotated and the grace of the secret it used is over")
    return None


class KeyWatch:
    def __init__(self, keys: KeyStore, interval: float) -> None:
        self._keys = keys
        self.interval = max(interval, MIN_INTERVAL)
        # key id → work in flight: its principal, how to end it, and its request's id (for the log line)
        self._work: dict[str, dict[int, tuple[Principal, End, str | None]]] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self.ended = 0  # work ended so far (for tests and the log)

    def track(self, principal: Principal, end: End) -> int:
        """Register work running under `principal`; `end` is called (once) should the key stop standing.
        Returns the handle to `untrack` it with."""
        handle = next(self._ids)
        if principal.key_id != ADMIN_ENV_KEY_ID:  # the environment's admin key is not in the store
            self._work.setdefault(principal.key_id, {})[handle] = (principal, end, request_id.get())
        return handle

    def untrack(self, principal: Principal, handle: int) -> None:
        work = self._work.get(principal.key_id)
        if work is not None:
            work.pop(handle, None)
            if not work:
                del self._work[principal.key_id]

    def open_work(self) -> int:
        return sum(len(work) for work in self._work.values())

    async def sweep(self) -> None:
        """Read each key with work in flight once; end the work of those that no longer stand."""
        for key_id in list(self._work):
            record = await self._keys.key_by_id(key_id)
            now = time.time()
            for handle, (principal, end, rid) in list(self._work.get(key_id, {}).items()):
                error = ended(principal, record, now)
                if error is None:
                    continue
                self.untrack(principal, handle)
                self.ended += 1
                log.info("work of key %s ended: %s", principal.fingerprint, error.message, extra={"request_id": rid})
                end(error)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self._work:
                continue
            try:
                await self.sweep()
            except APIError as exc:  # the store is away: the work goes on, read again next time
                log.warning("keys with work in flight could not be read again: %s", exc.message)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="key-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
