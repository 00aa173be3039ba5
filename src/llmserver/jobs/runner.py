"""The job service: submit, run in the background, encrypt, store, deliver, hand out once.

The client's key lives only in the running job's coroutine, until its result is encrypted; it is
never stored, logged or put in an error. The plaintext is never stored either. Job state (owner,
status, nonce, ciphertext, times, the gateway that runs it) is in the store, so ready results survive a
restart and any gateway sharing the store answers a poll; a job whose gateway stopped or died while
it ran is failed by the sweep of that gateway's lease (cluster/gateways.py). Webhooks go through the outbox.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.auth.revocation import KeyWatch
from llmserver.errors import APIError, InvalidRequest, NotFound, ServerError
from llmserver.inputs.safe_fetch import check_url
from llmserver.jobs import crypto
from llmserver.jobs.webhooks import WebhookOutbox
from llmserver.settings import Settings
from llmserver.store import AuditStore, JobRecord, JobStore, OutboxStore, UsageStore

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Work = Callable[[], Awaitable[JSON]]

GONE_MESSAGE = "Unknown tracking_id, expired, or its result was already consumed — stop polling."


class JobGone(NotFound):
    def __init__(self) -> None:
        super().__init__(GONE_MESSAGE)


class JobService:
    def __init__(
        self, settings: Settings, store: JobStore, usage: UsageStore, outbox: OutboxStore, audit: AuditStore
    ) -> None:
        self.settings = settings
        self.store = store
        self.usage = usage
        self.audit = audit
        self.gateway_id = settings.state.gateway_id
        self._outbox_store = outbox
        self.outbox = WebhookOutbox(
            outbox,
            self.gateway_id,
            attempts=settings.jobs.webhook_max_attempts,
            timeout=settings.jobs.webhook_timeout,
            allow_private=settings.jobs.webhook_allow_private,
            max_url_length=settings.limits.max_url_length,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        # Ends a job whose key stops standing while it waits or runs (auth/revocation.py); set by the app.
        self.key_watch: KeyWatch | None = None
        self._ended: dict[str, APIError] = {}  # tracking id → why its work was cancelled
        self.finished: collections.Counter[str] = collections.Counter()  # this gateway's jobs, by outcome
        self._sweeper: asyncio.Task[None] | None = None

    async def store_outbox_depth(self) -> int:
        return await self._outbox_store.outbox_depth()

    @property
    def running(self) -> int:
        """Async jobs this gateway is running now."""
        return len(self._tasks)

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="jobs-sweep")
        self.outbox.start()

    async def stop(self, grace: float = 0.0) -> None:
        """Let running jobs finish for up to `grace` seconds (the server's drain_timeout), then cancel
        what is left: those become `failed` with a message to resubmit at the next start."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._tasks and grace > 0:
            log.info("waiting up to %.0f s for %d async jobs to finish", grace, len(self._tasks))
            await asyncio.wait(list(self._tasks), timeout=grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.outbox.stop()
        if self._sweeper is not None:
            await asyncio.wait({self._sweeper})

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.jobs.sweep_interval)
            try:
                removed = await self.store.delete_expired_jobs(time.time())
                if removed:
                    log.info("removed %d expired async results", removed)
                # The usage ledger's retention rides on the same sweep.
                old = await self.usage.delete_usage_before(
                    time.time() - self.settings.state.usage_retention_days * 86400
                )
                if old:
                    log.info(
                        "removed %d usage rows older than %.0f days", old, self.settings.state.usage_retention_days
                    )
                # And the audit log's.
                days = self.settings.state.audit_retention_days
                audited = await self.audit.delete_audit_before(time.time() - days * 86400)
                if audited:
                    log.info("removed %d audit rows older than %.0f days", audited, days)
            except APIError as exc:  # the store is away: the next sweep tries again (this one died of it)
                log.warning("the sweep of expired async results waits for the store: %s", exc.message)

    # Submitting

    @staticmethod
    def client_key(key: str | None) -> bytes:
        """The async `key` (checked before anything else is done for the request)."""
        if key is None:
            raise InvalidRequest("Async mode needs `key`: base64 of 32 random bytes.", param="key")
        return crypto.decode_key(key)

    async def submit(self, principal: Principal, work: Work, *, key: bytes, webhook_url: str | None) -> JSON:
        """Start `work` in the background; its JSON result will be encrypted under the client's key."""
        if webhook_url is not None:
            await check_url(
                webhook_url,
                param="webhook_url",
                allow_private=self.settings.jobs.webhook_allow_private,
                max_length=self.settings.limits.max_url_length,
            )
        return await self._adopt(principal, key, webhook_url, work)

    async def sync_or_fallback(self, principal: Principal, work: Work) -> JSON:
        """Run `work`; if it has not finished within sync_timeout, keep it running as an async job and
        answer with the job's payload plus a server-made `key` (the client has no other way to get it)."""
        task = asyncio.ensure_future(work())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.settings.jobs.sync_timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        key = crypto.new_key()
        payload = await self._adopt(principal, key, None, task)
        log.info(
            "request passed sync_timeout (%.0f s): now async job %s",
            self.settings.jobs.sync_timeout,
            payload["tracking_id"],
        )
        return {**payload, "key": crypto.b64(key)}

    async def _adopt(
        self, principal: Principal, key: bytes, webhook_url: str | None, task: asyncio.Future[JSON] | Work
    ) -> JSON:
        """Record the job, then run it (a `Work` starts only once the job is recorded)."""
        tracking_id = str(uuid.uuid4())
        nonce = crypto.new_nonce()
        await self.store.insert_job(
            tracking_id, principal.key_id, crypto.b64(nonce), time.time(), self.gateway_id, webhook_url
        )
        if not isinstance(task, asyncio.Future):
            task = asyncio.ensure_future(task())
        work = task
        watch = self.key_watch
        watched = watch.track(principal, lambda error: self._end(tracking_id, work, error)) if watch else 0
        runner = asyncio.create_task(
            self._finish(tracking_id, task, key, nonce, webhook_url), name=f"job-{tracking_id}"
        )
        if watch is not None:
            runner.add_done_callback(lambda _: watch.untrack(principal, watched))
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
            ended = self._ended.pop(tracking_id, None)
            current = asyncio.current_task()
            if ended is None or (current is not None and current.cancelling()):
                task.cancel()
                raise
            error = ended.body()  # its key stopped standing: its work was cancelled, not this job's runner
        except Exception as exc:
            log.error("async job %s failed: %s", tracking_id, type(exc).__name__)
            error = ServerError("The generation failed.").body()
        finally:
            del key
        webhook: tuple[str, str] | None = None
        if webhook_url is not None:
            payload: JSON = {"status": "ready", "tracking_id": tracking_id, "result": result}
            if result is None:
                payload = {"status": "failed", "tracking_id": tracking_id, "error": (error or {}).get("error")}
            webhook = (webhook_url, json.dumps(payload))
        await self._store_outcome(tracking_id, result, json.dumps(error) if error is not None else None, webhook)
        self.finished["ready" if result is not None else "failed"] += 1
        log.info("async job %s %s", tracking_id, "ready" if result is not None else "failed")
        if webhook is not None:
            self.outbox.wake()

    def _end(self, tracking_id: str, work: asyncio.Future[JSON], error: APIError) -> None:
        """Cancel a job's work (waiting for a slot or generating): its key no longer stands."""
        if not work.done():
            self._ended[tracking_id] = error
            work.cancel()

    async def _store_outcome(
        self, tracking_id: str, result: str | None, error: str | None, webhook: tuple[str, str] | None
    ) -> None:
        """Write the outcome, retrying while the store is unreachable (for as long as a result is kept):
        a finished job must not stay `pending`."""
        delay, deadline = 1.0, time.monotonic() + self.settings.jobs.result_ttl
        while True:
            now = time.time()
            try:
                await self.store.finish_job(
                    tracking_id,
                    result=result,
                    error=error,
                    now=now,
                    expires_at=now + self.settings.jobs.result_ttl,
                    webhook=webhook,
                )
                return
            except APIError:
                if time.monotonic() > deadline:
                    raise
                log.warning("async job %s: its outcome cannot be stored yet; retrying in %.0f s", tracking_id, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)

    # Polling

    async def poll(self, principal: Principal, tracking_id: str) -> tuple[JSON, JobRecord | None]:
        """The poll answer, and the claimed job whose deletion waits until the answer was sent."""
        now = time.time()
        job = await self.store.job(tracking_id, principal.key_id, now)
        if job is None or job.status == "claimed":
            raise JobGone()
        if job.status == "pending":
            return {"status": "pending"}, None
        claimed = await self.store.claim_job(tracking_id, principal.key_id, now, self.gateway_id)
        if claimed is None:  # another poll took it in between
            raise JobGone()
        if claimed.result is not None:
            return {"status": "ready", "result": claimed.result}, claimed
        error = json.loads(claimed.error) if claimed.error else ServerError("The job failed.").body()
        return {"status": "failed", "error": error.get("error", error)}, claimed

    async def delivered(self, job: JobRecord) -> None:
        await self.store.delete_job(job.tracking_id)

    async def undelivered(self, job: JobRecord) -> None:
        await self.store.release_claim(job.tracking_id)
