"""Webhook delivery: POST the finished job's payload, retrying network errors and 5xx with backoff.

The URL is checked again at delivery (its name may resolve differently by now) and the connection is
pinned to the addresses checked. Delivery never consumes the result: polling still works.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from llmserver.errors import InvalidRequest
from llmserver.inputs.safe_fetch import MAX_URL_LENGTH, check_url, post_json

log = logging.getLogger(__name__)


async def deliver(
    url: str,
    payload: dict[str, Any],
    *,
    attempts: int,
    timeout: float,
    allow_private: bool,
    max_url_length: int = MAX_URL_LENGTH,
    first_delay: float = 0.5,
) -> bool:
    """True once the receiver answered 2xx; False when it refused or every attempt failed."""
    tracking_id = payload.get("tracking_id")
    delay = first_delay
    for attempt in range(1, attempts + 1):
        try:
            checked = await check_url(url, param="webhook_url", allow_private=allow_private, max_length=max_url_length)
            status = await post_json(checked, payload, timeout=timeout)
        except InvalidRequest as exc:
            log.warning("webhook for job %s not sent: %s", tracking_id, exc.message)
            return False
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("webhook for job %s: attempt %d failed: %s", tracking_id, attempt, type(exc).__name__)
        else:
            if 200 <= status < 300:
                log.info("webhook for job %s delivered (attempt %d)", tracking_id, attempt)
                return True
            if status < 500:
                log.warning("webhook for job %s refused with %d; not retrying", tracking_id, status)
                return False
            log.warning("webhook for job %s: attempt %d answered %d", tracking_id, attempt, status)
        if attempt < attempts:
            await asyncio.sleep(delay)
            delay *= 2
    log.error("webhook for job %s failed after %d attempts", tracking_id, attempts)
    return False
