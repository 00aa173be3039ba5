"""The app's outermost layer, one pure-ASGI frame for what every request needs: the body-size limit,
the quota headers, the access log, the server's own `send` for streams, and the generation
endpoints' lane past FastAPI.

- The access log never writes the query string, which may hold an `api_key`; it names the caller by
  key fingerprint only.
- Streams (`api/events.EventStream`) send their start and end through this layer and each chunk of
  the body straight to the server's `send`, which is left in the scope under `RAW_SEND`: nothing here
  acts on a body chunk, and a token's wake-up resumes no frame of ours or Starlette's above the stream.
- The generation endpoints (POST `/v1/chat/completions`, `/v1/completions`, `/api/generate`, marked
  `api/deps.direct` in FastAPI's one route table) are called directly, past Starlette's error
  middleware, FastAPI's exception and exit-stack middleware, the route matching and FastAPI's request
  handler: they take nothing from FastAPI (they read their own bodies, see `api/deps.parse`). Their
  errors are rendered by the app's own handlers, the ones FastAPI calls for every other endpoint (the
  one envelope).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserver import tracing
from llmserver.api.deps import scope_header
from llmserver.api.events import RAW_SEND
from llmserver.auth.audit import Audit
from llmserver.auth.keys import Principal
from llmserver.auth.quota import QuotaService
from llmserver.errors import APIError, RequestTooLarge
from llmserver.logs import new_request_id, request_id

access_log = logging.getLogger("llmserver.access")
# What a path may hold unencoded (RFC 3986's pchar and "/"): anything else is %-encoded in the text log.
PATH_CHARACTERS = "/:@!$&'()*+,;=-._~"

Endpoint = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class Front:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        quota: Callable[[], QuotaService],
        audit: Callable[[], Audit],
        hot: Mapping[str, Endpoint],
        api_error: ErrorHandler,
        unexpected: ErrorHandler,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._quota = quota  # built in the app's lifespan, after this layer
        self._audit = audit  # the same
        self.hot = hot  # path → endpoint, for POST
        self.api_error = api_error
        self.unexpected = unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RAW_SEND] = send
        logged = access_log.isEnabledFor(logging.INFO)
        started = time.perf_counter() if logged else 0.0
        status = 0
        created: str | None = None  # what an audited create made (its answer names it)
        sent_id = scope_header(scope, b"x-request-id")
        rid = new_request_id(sent_id.decode("latin-1") if sent_id is not None else None)
        rid_token = request_id.set(rid)  # in every log line of this request, and its tasks'
        id_header = (b"x-request-id", rid.encode())

        async def front_send(message: Message) -> None:
            nonlocal status, created
            if status == 201 and created is None and "audit" in scope.get("state", {}):
                created = created_name(message.get("body", b""))
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), id_header]}
                principal = scope.get("state", {}).get("principal")
                if principal is not None and principal.limits.quota_tokens is not None:
                    message = await self._with_quota_headers(principal, message)
            await send(message)

        try:
            if tracing.on():
                attributes = {"http.request.method": scope["method"], "url.path": scope["path"], "request_id": rid}
                with tracing.server_span(f"{scope['method']} {scope['path']}", scope["headers"], attributes) as span:
                    await self._serve(scope, receive, front_send)
                    span.set_attribute("http.response.status_code", status or 500)
            else:
                await self._serve(scope, receive, front_send)
        finally:
            del scope[RAW_SEND]  # the server's `send` points at its connection: nothing keeps it past here
            if (action := scope.get("state", {}).get("audit")) is not None:  # an admin action, noted by its route
                self._audit().record(action, status or 500, created)
            if logged:
                _log_access(scope, status, started)
            request_id.reset(rid_token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, _too_large(self.max_bytes), scope["path"])
            return
        if declared is None:  # chunked: count what arrives (no more than a declared length can)
            receive = _counting(receive, self.max_bytes)
        endpoint = self.hot.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
        else:
            await self._call(endpoint, scope, receive, send)

    async def _call(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except APIError as exc:
            response = await self.api_error(request, exc)
        except Exception as exc:
            response = await self.unexpected(request, exc)
        await response(scope, receive, send)

    async def _with_quota_headers(self, principal: Principal, start: Message) -> Message:
        """x-ratelimit-*-tokens on every answer to a key that has a token quota (errors included)."""
        try:
            headers = await self._quota().headers(principal)
        except APIError:
            return start  # the database went away after the answer was made: send it without them
        extra = [(k.encode(), v.encode()) for k, v in headers.items()]
        return {**start, "headers": [*start.get("headers", []), *extra]}


def created_name(body: bytes) -> str | None:
    """What a create's JSON answer names the new thing by (a key's id, an instance's, a model's name)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(answer, dict):
        for field in ("id", "instance_id", "name"):
            if isinstance(answer.get(field), str):
                return str(answer[field])
    return None


def _content_length(scope: Scope) -> int | None:
    value = scope_header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _counting(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counting_receive() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)  # rendered by the APIError handler
        return message

    return counting_receive


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than this server's limit of {limit} bytes.")


async def _send_error(send: Send, error: RequestTooLarge, path: str) -> None:
    body = json.dumps(error.body_for(path)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _log_access(scope: Scope, status: int, started: float) -> None:
    state = scope.get("state", {})
    principal, tally = state.get("principal"), state.get("tally")
    duration = (time.perf_counter() - started) * 1000
    fields: dict[str, object] = {
        "method": scope["method"], "path": scope["path"], "status": status or 500, "duration_ms": round(duration, 1)
    }  # fmt: skip
    if (error := state.get("error")) is not None:  # an error's answer: which, and what it said
        fields["error_type"], fields["error_message"] = error[0], error[1][:500]
    who = ""
    if principal is not None:
        who = f" key={principal.fingerprint}"
        fields["key"] = principal.fingerprint
    if tally is not None:
        fields.update(model=tally.model, instance=tally.instance_id, prompt_tokens=tally.prompt_tokens,
                      completion_tokens=tally.completion_tokens, cached_tokens=tally.cached_tokens)  # fmt: skip
        if tally.ttft is not None:
            fields["ttft_ms"] = round(tally.ttft * 1000, 1)
        if tally.prompt_tokens:  # prompt-cache reuse: cached/prompt tokens
            who += f" instance={tally.instance_id} cached={tally.cached_tokens}/{tally.prompt_tokens}"
    # The line names the path as a URL would (re-encoded): a decoded %0A or " must not forge or break a line.
    shown = urllib.parse.quote(scope["path"], safe=PATH_CHARACTERS)
    access_log.info("%s %s %s %.1fms%s", scope["method"], shown, status or 500, duration, who, extra=fields)
