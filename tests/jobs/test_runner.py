"""The job runner on each store engine: results encrypted and handed out once, failures kept, a
gateway's stop failing only its own running jobs, and the sync→async fallback."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt

from llmserver.auth.keys import Principal
from llmserver.cluster.gateways import GatewayLease
from llmserver.errors import InvalidRequest
from llmserver.jobs import crypto
from llmserver.jobs.runner import JobGone, JobService
from llmserver.settings import Settings
from llmserver.store import AuditQuery, open_store

ALICE = Principal("key_a", "alice", "aaaaaaaa", False)
BOB = Principal("key_b", "bob", "bbbbbbbb", False)


@asynccontextmanager
async def runner(database_url: str, gateway: str = "gw1", **jobs: Any) -> AsyncIterator[JobService]:
    """A job service with its gateway's lease, stopped as the server stops it; its [jobs] settings `jobs`."""
    store = await open_store(database_url)
    settings = Settings(data_dir=Path("/nonexistent"), state={"gateway_id": gateway}, jobs=jobs)
    lease = GatewayLease(store, store, gateway, lease=10.0, job_ttl=settings.jobs.result_ttl, produced=dict)
    await lease.start()
    service = JobService(settings, store, store, store, store)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        await lease.stop()
        await store.close()


async def poll_until_done(service: JobService, who: Principal, tracking_id: str) -> dict[str, Any]:
    for _ in range(500):
        answer, claimed = await service.poll(who, tracking_id)
        if claimed is not None:
            await service.delivered(claimed)
            return answer
        await asyncio.sleep(0.01)
    raise AssertionError("the job never finished")


def decrypt(result: str, key: bytes, nonce: str) -> dict[str, Any]:
    plain = crypto_aead_xchacha20poly1305_ietf_decrypt(base64.b64decode(result), None, base64.b64decode(nonce), key)
    return json.loads(plain)  # type: ignore[no-any-return]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_a_result_is_encrypted_and_handed_out_once_to_its_owner(database_url: str) -> None:
    async def scenario() -> None:
        async with runner(database_url) as service:
            key = crypto.new_key()
            release = asyncio.Event()

            async def work() -> dict[str, Any]:
                await release.wait()
                return {"response": "hello"}

            payload = await service.submit(ALICE, work, key=key, webhook_url=None)
            assert payload["method"] == "xchacha20" and set(payload) == {"mode", "tracking_id", "method", "nonce"}
            assert await service.poll(ALICE, payload["tracking_id"]) == ({"status": "pending"}, None)
            with pytest.raises(JobGone):
                await service.poll(BOB, payload["tracking_id"])  # another key's job does not exist for it
            release.set()
            done = await poll_until_done(service, ALICE, payload["tracking_id"])
            assert decrypt(done["result"], key, payload["nonce"]) == {"response": "hello"}
            with pytest.raises(JobGone):
                await service.poll(ALICE, payload["tracking_id"])  # consumed

    run(scenario)


def test_a_failed_job_keeps_its_error(database_url: str) -> None:
    async def scenario() -> None:
        async with runner(database_url) as service:

            async def work() -> dict[str, Any]:
                raise InvalidRequest("no such thing", param="x")

            payload = await service.submit(ALICE, work, key=crypto.new_key(), webhook_url=None)
            done = await poll_until_done(service, ALICE, payload["tracking_id"])
            assert done == {
                "status": "failed",
                "error": {"message": "no such thing", "type": "invalid_request_error", "code": 400, "param": "x"},
            }

    run(scenario)


def test_a_stop_fails_only_this_gateways_running_jobs(database_url: str) -> None:
    async def scenario() -> None:
        never = asyncio.Event()

        async def work() -> dict[str, Any]:
            await never.wait()
            return {}

        async with runner(database_url, "gw2") as other:
            async with runner(database_url, "gw1") as first:
                mine = await first.submit(ALICE, work, key=crypto.new_key(), webhook_url=None)
                theirs = await other.submit(ALICE, work, key=crypto.new_key(), webhook_url=None)
            # gw1 stopped (its job's key is lost with it) and starts again, while gw2 runs on.
            async with runner(database_url, "gw1") as restarted:
                answer, claimed = await restarted.poll(ALICE, mine["tracking_id"])
                assert answer["status"] == "failed" and "submit it again" in answer["error"]["message"]
                assert claimed is not None
                assert await restarted.poll(ALICE, theirs["tracking_id"]) == ({"status": "pending"}, None)

    run(scenario)


def test_a_sync_request_past_sync_timeout_becomes_a_job(database_url: str) -> None:
    async def scenario() -> None:
        async with runner(database_url, sync_timeout=0.05) as service:

            async def quick() -> dict[str, Any]:
                return {"response": "fast"}

            assert await service.sync_or_fallback(ALICE, quick) == {"response": "fast"}
            release = asyncio.Event()

            async def slow() -> dict[str, Any]:
                await release.wait()
                return {"response": "slow"}

            payload = await service.sync_or_fallback(ALICE, slow)
            assert payload["mode"] == "async" and "key" in payload  # the server-made key: no other way to get it
            release.set()
            done = await poll_until_done(service, ALICE, payload["tracking_id"])
            assert decrypt(done["result"], base64.b64decode(payload["key"]), payload["nonce"]) == {"response": "slow"}

    run(scenario)


def test_the_outbox_stops_when_woken_at_the_stop(tmp_path: Path) -> None:
    """A job that ends as the server stops wakes the outbox in the same step as its cancellation: Python
    3.11's wait_for swallowed that cancellation and the outbox loop never ended (a SIGTERM stop hung
    until it was killed, 2 of 4 two-minute soaks with a job running at the stop)."""
    from llmserver.jobs.webhooks import WebhookOutbox

    async def scenario() -> None:
        store = await open_store(f"sqlite:///{tmp_path / 'outbox.db'}")
        try:
            for _ in range(20):  # the race is in one step: every try hits it
                outbox = WebhookOutbox(store, "gw1", attempts=1, timeout=1.0, allow_private=True, poll=30.0)
                outbox.start()
                await asyncio.sleep(0.01)  # its loop waits on the wake-up event now
                outbox.wake()
                stopping = asyncio.ensure_future(outbox.stop())
                await asyncio.wait({stopping}, timeout=5)  # (a timeout here cancels nothing)
                stuck = not stopping.done()
                stopping.cancel()  # a second cancellation ends the old loop: the test can clean up
                await asyncio.wait({stopping})
                assert not stuck
        finally:
            await store.close()

    run(scenario)


def test_the_sweep_removes_audit_rows_past_their_retention(database_url: str) -> None:
    """state.audit_retention_days rides on the job sweep, with the ledger's retention."""

    async def test() -> None:
        async with runner(database_url, sweep_interval=0.05) as service:
            row = {"key_id": "a", "key_name": "ops", "action": "keys.create", "target": None, "change": None,
                   "status": 201, "client": None, "request_id": None}  # fmt: skip
            now = time.time()
            await service.audit.audit_append({**row, "time": now - 401 * 86400})
            await service.audit.audit_append({**row, "time": now})
            for _ in range(200):
                kept = await service.audit.audit_page(AuditQuery())
                if len(kept) == 1:
                    break
                await asyncio.sleep(0.02)
            assert [r["time"] for r in kept] == [now]

    asyncio.run(test())
