"""Webhook delivery through an outbox: a finished job's payload is queued in the store in the same
transaction as its result, and any gateway's deliverer sends it, so a delivery survives a restart.

A deliverer claims due items for a while (one gateway sends each at a time), POSTs each, and deletes
it on a 2xx or on a refusal (a 4xx, or a URL that no longer passes the checks); network errors and
5xx are retried with doubling delays, up to `webhook_max_attempts` in all. The URL is checked again
at delivery (its name may resolve differently by now) and the connection is pinned to the addresses
checked. Delivery never consumes the result: polling still works.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from enum import Enum

import aiohttp

from llmserver import tracing
from llmserver.errors import APIError, InvalidRequest
from llmserver.inputs.safe_fetch import MAX_URL_LENGTH, check_url, post_json
from llmserver.outage import Outage
from llmserver.store import OutboxItem, OutboxStore

log = logging.getLogger(__name__)

BATCH = 16
OPERATORS = "budget:"  # the outbox items whose URL comes from the server's settings (store.alert_id)
MAX_POLL = 8.0  # seconds between looks for other gateways' items, while none turn up


class Attempt(Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"
    FAILED = "failed"  # worth another try


async def attempt(
    url: str, payload: dict[str, object], *, timeout: float, allow_private: bool, max_url_length: int = MAX_URL_LENGTH
) -> Attempt:
    """One POST of the payload; what came of it."""
    tracking_id = payload.get("tracking_id")
    try:
        checked = await check_url(url, param="webhook_url", allow_private=allow_private, max_length=max_url_length)
        status = await post_json(checked, payload, timeout=timeout)
    except InvalidRequest as exc:
        log.warning("webhook for job %s not sent: %s", tracking_id, exc.message)
        return Attempt.REFUSED
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.warning("webhook for job %s failed: %s", tracking_id, type(exc).__name__)
        return Attempt.FAILED
    if 200 <= status < 300:
        return Attempt.DELIVERED
    if status < 500:
        log.warning("webhook for job %s refused with %d; not retrying", tracking_id, status)
        return Attempt.REFUSED
    log.warning("webhook for job %s answered %d", tracking_id, status)
    return Attempt.FAILED


class WebhookOutbox:
    def __init__(
        self,
        store: OutboxStore,
        gateway_id: str,
        *,
        attempts: int,
        timeout: float,
        allow_private: bool,
        max_url_length: int = MAX_URL_LENGTH,
        poll: float = 1.0,
        first_delay: float = 0.5,
    ) -> None:
        self._store = store
        self._gateway_id = gateway_id
        self._attempts = attempts
        self._timeout = timeout
        self._allow_private = allow_private
        self._max_url_length = max_url_length
        self._poll = poll
        self._first_delay = first_delay
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._outage = Outage(log)
        self.attempts: collections.Counter[str] = collections.Counter()  # delivered, retried, failed, refused

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="webhook-outbox")

    async def stop(self) -> None:
        """Stop sending; what is still queued is sent by this or another gateway later."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # (a cancellation of the caller is not swallowed here)

    def wake(self) -> None:
        """An item was queued: look now rather than at the next poll."""
        self._wake.set()

    async def _run(self) -> None:
        # This gateway's own items wake it (queued, or a retry falling due); a poll finds those other
        # gateways left behind. It polls every `poll` seconds after finding some, and less often
        # while it finds none, up to every MAX_POLL seconds: an idle gateway wakes its store less.
        wait = self._poll
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that comes
            # as the event is set (a job's wake-up at a stop), and this loop then never ended.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            quiet = not self._wake.is_set()
            self._wake.clear()
            idle_wait, wait = min(wait * 2, MAX_POLL), self._poll
            try:
                while items := await self._store.outbox_claim(self._gateway_id, self._claim_seconds, BATCH):
                    quiet = False
                    await asyncio.gather(*(self._send(item) for item in items))
            except APIError as exc:
                self._outage.failed("webhook outbox cannot be read: %s", exc.message)
                continue
            except Exception:
                log.exception("webhook outbox")
                continue
            self._outage.recovered("webhook outbox can be read again")
            if quiet:
                wait = idle_wait

    @property
    def _claim_seconds(self) -> float:
        return 2 * self._timeout + 10

    async def _send(self, item: OutboxItem) -> None:
        payload = json.loads(item.payload)
        tried = item.attempts + 1
        with tracing.span("webhook delivery", {"tracking_id": item.tracking_id, "attempt": tried}) as span:
            outcome = await attempt(
                item.url,
                payload,
                timeout=self._timeout,
                # A budget alert goes where the operator's settings say (billing.budget_webhook), often an
                # internal address; a job's goes where its client said, so not to private ones by default.
                allow_private=self._allow_private or item.tracking_id.startswith(OPERATORS),
                max_url_length=self._max_url_length,
            )
            if span is not None:
                span.set_attribute("outcome", outcome.value)
        self.attempts[
            "delivered" if outcome is Attempt.DELIVERED
            else "refused" if outcome is not Attempt.FAILED
            else "retried" if tried < self._attempts
            else "failed"
        ] += 1  # fmt: skip
        if outcome is Attempt.DELIVERED:
            log.info("webhook for job %s delivered (attempt %d)", item.tracking_id, tried)
        elif outcome is Attempt.FAILED and tried < self._attempts:
            delay = self._first_delay * 2 ** (tried - 1)
            await self._store.outbox_retry(item.id, tried, delay)
            asyncio.get_running_loop().call_later(delay, self._wake.set)  # a look when it falls due
            return
        elif outcome is Attempt.FAILED:
            log.error("webhook for job %s failed after %d attempts", item.tracking_id, tried)
        await self._store.outbox_done(item.id)
