"""The job service: submit, run in the background, encrypt, store, deliver, hand out once.

The client's key lives only in the running job's coroutine, until its result is encrypted; it is
never stored, logged or put in an error. The plaintext is never stored either. Job state (owner,
status, nonce, ciphertext, times) is in the store, so ready results survive a restart; jobs running
at a restart are marked failed at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.errors import APIError, InvalidRequest, NotFound, ServerError, error_body
from llmserver.inputs.safe_fetch import check_url
from llmserver.jobs import crypto, webhooks
from llmserver.settings import Settings
from llmserver.store import JobRecord, SQLiteStore

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Work = Callable[[], Awaitable[JSON]]

GONE_MESSAGE = "Unknown tracking_id, expired, or its result was already consumed — stop polling."
RESTARTED = error_body(500, "server_error", "The server restarted while this job was running; submit it again.")


class JobGone(NotFound):
    def __init__(self) -> None:
        super().__init__(GONE_MESSAGE)


class JobService:
    def __init__(self, settings: Settings, store: SQLiteStore) -> None:
        self.settings = settings
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        now = time.time()
        failed = self.store.fail_interrupted_jobs(json.dumps(RESTARTED), now, now + self.settings.async_result_ttl)
        if failed:
            log.warning("%d async jobs were running when the server last stopped: marked failed", failed)
        self._sweeper = asyncio.create_task(self._sweep(), name="jobs-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sweeper is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.job_sweep_interval)
            removed = self.store.delete_expired_jobs(time.time())
            if removed:
                log.info("removed %d expired async results", removed)
            # The usage ledger's retention rides on the same sweep.
            old = self.store.delete_usage_before(time.time() - self.settings.usage_retention_days * 86400)
            if old:
                log.info("removed %d usage rows older than %.0f days", old, self.settings.usage_retention_days)

    # Submitting

    async def submit(self, principal: Principal, work: Work, *, key: str | None, webhook_url: str | None) -> JSON:
        """Start `work` in the background; its JSON result will be encrypted under the client's key."""
        if key is None:
            raise InvalidRequest("Async mode needs `key`: base64 of 32 random bytes.", param="key")
        raw_key = crypto.decode_key(key)
        if webhook_url is not None:
            await check_url(webhook_url, param="webhook_url", allow_private=self.settings.webhook_allow_private)
        task = asyncio.ensure_future(work())
        return self._adopt(principal, task, raw_key, webhook_url)

    async def sync_or_fallback(self, principal: Principal, work: Work) -> JSON:
        """Run `work`; if it has not finished within sync_timeout, keep it running as an async job and
        answer with the job's payload plus a server-made `key` (the client has no other way to get it)."""
        task = asyncio.ensure_future(work())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.settings.sync_timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        key = crypto.new_key()
        payload = self._adopt(principal, task, key, None)
        log.info(
            "request passed sync_timeout (%.0f s): now async job %s", self.settings.sync_timeout, payload["tracking_id"]
        )
        return {**payload, "key": crypto.b64(key)}

    def _adopt(self, principal: Principal, task: asyncio.Future[JSON], key: bytes, webhook_url: str | None) -> JSON:
        tracking_id = str(uuid.uuid4())
        nonce = crypto.new_nonce()
        self.store.insert_job(tracking_id, principal.key_id, crypto.b64(nonce), time.time())
        runner = asyncio.create_task(
            self._finish(tracking_id, task, key, nonce, webhook_url), name=f"job-{tracking_id}"
        )
        self._tasks.add(runner)
        runner.add_done_callback(self._tasks.discard)
        return {"mode": "async", "tracking_id": tracking_id, "method": crypto.METHOD, "nonce": crypto.b64(nonce)}

    async def _finish(
        self, tracking_id: str, task: asyncio.Future[JSON], key: bytes, nonce: bytes, webhook_url: str | None
    ) -> None:
        result: str | None = None
        error: JSON | None = None
        try:
            plaintext = json.dumps(await task, ensure_ascii=False).encode()
            result = crypto.encrypt(plaintext, key, nonce)
            del plaintext
        except APIError as exc:
            error = exc.body()
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:
            log.error("async job %s failed: %s", tracking_id, type(exc).__name__)
            error = ServerError("The generation failed.").body()
        finally:
            del key
        now = time.time()
        self.store.finish_job(
            tracking_id,
            result=result,
            error=json.dumps(error) if error is not None else None,
            now=now,
            expires_at=now + self.settings.async_result_ttl,
        )
        log.info("async job %s %s", tracking_id, "ready" if result is not None else "failed")
        if webhook_url is not None:
            payload: JSON = {"status": "ready", "tracking_id": tracking_id, "result": result}
            if result is None:
                payload = {"status": "failed", "tracking_id": tracking_id, "error": (error or {}).get("error")}
            await webhooks.deliver(
                webhook_url,
                payload,
                attempts=self.settings.webhook_max_attempts,
                timeout=self.settings.webhook_timeout,
                allow_private=self.settings.webhook_allow_private,
            )

    # Polling

    def poll(self, principal: Principal, tracking_id: str) -> tuple[JSON, JobRecord | None]:
        """The poll answer, and the claimed job whose deletion waits until the answer was sent."""
        now = time.time()
        job = self.store.job(tracking_id, principal.key_id, now)
        if job is None or job.status == "claimed":
            raise JobGone()
        if job.status == "pending":
            return {"status": "pending"}, None
        claimed = self.store.claim_job(tracking_id, principal.key_id, now)
        if claimed is None:  # another poll took it in between
            raise JobGone()
        if claimed.result is not None:
            return {"status": "ready", "result": claimed.result}, claimed
        error = json.loads(claimed.error) if claimed.error else ServerError("The job failed.").body()
        return {"status": "failed", "error": error.get("error", error)}, claimed

    def delivered(self, job: JobRecord) -> None:
        self.store.delete_job(job.tracking_id)

    def undelivered(self, job: JobRecord) -> None:
        self.store.release_claim(job.tracking_id)
