"""Pure ASGI middleware (cheap on the hot path): the body-size limit and the access log.

The access log never writes the query string, which may hold an `api_key`; it names the caller by
key fingerprint only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserver.auth.quota import QuotaService
from llmserver.errors import APIError, RequestTooLarge

access_log = logging.getLogger("llmserver.access")


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than this server's limit of {limit} bytes.")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await _send_error(send, _too_large(self.max_bytes))
                    return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)  # rendered by the APIError handler
            return message

        await self.app(scope, counting_receive, send)


async def _send_error(send: Send, error: RequestTooLarge) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def logging_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            state = scope.get("state", {})
            principal, tally = state.get("principal"), state.get("tally")
            who = f" key={principal.fingerprint}" if principal is not None else ""
            if tally is not None and tally.prompt_tokens:  # prompt-cache reuse: cached/prompt tokens
                who += f" instance={tally.instance_id} cached={tally.cached_tokens}/{tally.prompt_tokens}"
            access_log.info(
                "%s %s %s %.1fms%s",
                scope["method"], scope["path"], status or 500, (time.perf_counter() - started) * 1000, who,
            )  # fmt: skip


class QuotaHeaders:
    """x-ratelimit-*-tokens on every answer to a key that has a token quota (errors included)."""

    def __init__(self, app: ASGIApp, quota: Callable[[], QuotaService]) -> None:
        self.app = app
        self._quota = quota  # built in the app's lifespan, after this middleware

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                principal = scope.get("state", {}).get("principal")
                if principal is not None and principal.limits.quota_tokens is not None:
                    try:
                        headers = await self._quota().headers(principal)
                    except APIError:
                        headers = {}  # the database went away after the answer was made: send it without them
                    extra = [(k.encode(), v.encode()) for k, v in headers.items()]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
