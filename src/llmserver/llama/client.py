"""An HTTP client for one llama-server instance: JSON calls and server-sent-event streams.

llama-server's own errors are mapped to our envelope by their structured `type`, never by text.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import ssl
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import orjson

from llmserver.errors import (
    APIError,
    ContextLengthExceeded,
    GatewayTimeout,
    InstanceUnavailable,
    InvalidRequest,
    UpstreamError,
)
from llmserver.llama import wire

log = logging.getLogger("llmserver.engine.client")  # its name before the move: log_levels name it

JSON = dict[str, Any]
PROBES = 2  # connections for probes at once: a /health and a /slots


class LlamaServerClient:
    def __init__(
        self, base_url: str, *, connections: int = 8, api_key: str | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.base_url = base_url
        # An instance on a worker host answers only to the key that gateways and its node share.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._headers = headers or {}
        # No timeout on a whole answer here: callers bound whole generations themselves.
        self._pool = wire.pool_for(base_url, limit=connections, headers=headers, tls=tls)
        # Probes (/health, /slots) on connections of their own: never behind requests for a connection.
        self._probes = wire.pool_for(base_url, limit=PROBES, headers=headers, tls=tls)

    async def close(self) -> None:
        await self._pool.close()
        await self._probes.close()

    async def health(self, timeout: float = 2.0) -> bool:
        """Whether llama-server answers /health with 200 within `timeout` seconds (its HTTP threads
        answer it, whatever its slots do); raises wire.Untrusted when its certificate is refused."""
        try:
            async with asyncio.timeout(timeout), _Sent(self._probes, "GET", "/health", None, False, None) as response:
                await response.read()
                return response.status == 200
        except wire.Untrusted:
            raise
        except (wire.WireError, TimeoutError):
            return False

    async def healthy(self, timeout: float = 2.0) -> bool:
        """`health`, a refused certificate counting as unhealthy."""
        try:
            return await self.health(timeout)
        except wire.Untrusted:
            return False

    def health_in_thread(self, timeout: float) -> bool:
        """`healthy`, blocking, for a thread of its own (`asyncio.to_thread`): on its own socket and
        clock, so that an event loop stalled by other work (a request's huge headers) delays the
        verdict but never makes a healthy instance miss its probe — an asyncio timeout would fire as
        the loop comes back, before the answer that came meanwhile is read."""
        pool = self._probes
        connection = (
            http.client.HTTPConnection(pool.host, pool.port, timeout=timeout)
            if pool.tls is None
            else http.client.HTTPSConnection(pool.host, pool.port, timeout=timeout, context=pool.tls)
        )
        try:
            connection.request("GET", "/health", headers=self._headers)
            response = connection.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    async def answers_slots(self, timeout: float) -> bool | None:
        """Whether llama-server's main loop answers /slots within `timeout` seconds: /health is answered
        by its HTTP threads alone, /slots waits for the loop that runs every slot. None when the instance
        cannot be reached at all (refused, or the connection dropped: its process died or is dying): that
        says nothing of its progress, and its exit or its missed health probes take it out of service."""
        try:
            async with asyncio.timeout(timeout), _Sent(self._probes, "GET", "/slots", None, False, None) as response:
                await response.read()
                return True
        except TimeoutError:
            return False
        except wire.WireError:
            return None

    async def get_json(self, path: str) -> JSON:
        try:
            async with self._request("GET", path) as response:
                return await _json_or_raise(response)
        except wire.WireError as exc:
            raise _unreachable(exc) from None

    def _request(
        self,
        method: str,
        path: str,
        payload: JSON | None = None,
        fresh: bool = False,
        deadline: float | None = None,
        stopper: wire.Stopper | None = None,
    ) -> AbstractAsyncContextManager[wire.Response]:
        """Send once. A connection that drops before any answer (llama-server may close connections
        just after a streamed answer ends) is InstanceUnavailable, which the one retry policy
        (`engine/calls.py`) sends again; `fresh`: on a new connection (a retry: the pool's other
        kept-alive ones may be as stale); `deadline`: the whole answer's (`wire.Pool.send`); `stopper`:
        ends it early from elsewhere (wire.Preempted)."""
        body = None if payload is None else orjson.dumps(payload)
        return _Sent(self._pool, method, path, body, fresh, deadline, stopper)

    async def post_json(self, path: str, payload: JSON, *, fresh: bool = False, timeout: float | None = None) -> JSON:
        """POST and read the JSON answer within `timeout` seconds (GatewayTimeout past it); `fresh`:
        on a new connection (a retry)."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:  # `_request`'s steps, written out: every non-streamed call comes here
            response = await self._pool.send("POST", path, orjson.dumps(payload), fresh=fresh, deadline=deadline)
            try:
                return await _json_or_raise(response)
            finally:
                self._pool.release(response)
        except wire.TimedOut:
            raise _past(timeout) from None
        except wire.WireError as exc:
            raise _unreachable(exc) from None

    async def stream(
        self,
        path: str,
        payload: JSON,
        *,
        fresh: bool = False,
        timeout: float | None = None,
        stopper: wire.Stopper | None = None,
    ) -> AsyncGenerator[list[bytes], Sink | None]:
        """POST with `stream: true` and yield the events' data (JSON text, unparsed: the relay parses
        only what it must) until `[DONE]`, as they arrived: one list per read from the socket (several
        when llama-server wrote them at once), so that the relay writes them to its client in one
        piece, and wakes up once for them. An error event raises. The whole stream is bounded by
        `timeout` seconds (GatewayTimeout past it).

        A `Sink` sent in (`asend`) takes the rest of the events instead, pumped from the connection's
        own callback (`_Pump`); they are yielded again once it asks to stop (its client is slow).

        Leaving the iteration early (a client that went away) closes the connection, which makes
        llama-server stop generating and free the slot; so does `stopper.stop()`, from any task, after
        which the iteration raises wire.Preempted.
        """
        try:
            async with asyncio.timeout(timeout), self._request("POST", path, payload, fresh, None, stopper) as response:
                if response.status != 200:
                    await _json_or_raise(response)
                events = EventSplitter()
                sink: Sink | None = None
                while not events.done:
                    if sink is not None:
                        if await _Pump(events, sink).run(response):
                            return
                        sink = None  # it asked to stop: yield again until another is sent
                    chunk = await response.readany()
                    if not chunk:
                        return
                    batch = events.feed(chunk)
                    if batch:
                        sink = yield batch
        except orjson.JSONDecodeError:
            raise UpstreamError("The model instance answered with a broken response.") from None
        except wire.WireError as exc:
            raise _unreachable(exc) from None
        except TimeoutError:
            raise _past(timeout) from None


Sink = Callable[[list[bytes]], bool]  # takes a batch of events' data; False: stop taking them for now


class EventSplitter:
    """llama-server's server-sent events, as the bytes arrive: the data of each whole event."""

    __slots__ = ("done", "pending")

    def __init__(self) -> None:
        self.pending = b""  # the start of an event still arriving
        self.done = False  # `[DONE]` came: what follows is not read

    def feed(self, chunk: bytes) -> list[bytes]:
        *complete, self.pending = (self.pending + chunk).split(b"\n\n")
        batch: list[bytes] = []
        for block in complete:
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        self.done = True
                        return batch
                    if b'"error"' in data:
                        _raise_error_event(orjson.loads(data))
                    batch.append(data)
                elif line.startswith(b"error:"):
                    raise upstream_error(orjson.loads(line[6:].strip()), 500)
        return batch


class _Pump:
    """Events from a response's body to a sink, called from the connection's own callback as the HTTP
    parser decodes each piece (a `wire.Tap`): no buffer, no task woken per token. It stops with True
    at the stream's end, with False when the sink asks (the rest is read as usual), or with the error."""

    __slots__ = ("events", "response", "sink", "stopped")

    def __init__(self, events: EventSplitter, sink: Sink) -> None:
        self.events, self.sink = events, sink
        self.response: wire.Response | None = None
        self.stopped: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def run(self, response: wire.Response) -> bool:
        self.response = response
        response.tap(self)
        try:
            return await self.stopped
        finally:
            response.tap(None)

    def data(self, chunk: bytes) -> None:
        if self.stopped.done():
            return
        try:
            batch = self.events.feed(chunk)
            going = self.sink(batch) if batch else True
        except Exception as exc:
            self.stop(exc)
            return
        if self.events.done or not going:
            self.stop(self.events.done)

    def stop(self, outcome: bool | BaseException) -> None:
        if self.response is not None:
            self.response.tap(None)  # what arrives from now on is buffered as usual
        if self.stopped.done():
            return
        if isinstance(outcome, BaseException):
            self.stopped.set_exception(outcome)
        else:
            self.stopped.set_result(outcome)


def _past(timeout: float | None) -> GatewayTimeout:
    return GatewayTimeout(f"The generation did not finish within {timeout or 0:.0f} s.")


def parse_event(data: bytes) -> JSON:
    """One event's data as JSON (UpstreamError if it is not a JSON object)."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise UpstreamError("The model instance answered with a broken response.") from None
    if not isinstance(event, dict):
        raise UpstreamError("The model instance answered with a broken response.")
    return event


def _raise_error_event(event: Any) -> None:
    """An event that is llama-server's error (not a token whose text says "error")."""
    if isinstance(event, dict) and "error" in event and "choices" not in event:
        raise upstream_error(event, 500)


class _Sent(AbstractAsyncContextManager[wire.Response]):
    """A request sent on entering, its response released on leaving: read to the end, the connection
    serves again; left early, closing it is what tells llama-server to stop generating. A class, not
    an @asynccontextmanager generator: every call to an instance goes through it, and a generator's
    context manager costs a few times as much to enter and leave."""

    __slots__ = ("_body", "_deadline", "_fresh", "_method", "_path", "_pool", "_response", "_stopper")

    def __init__(
        self,
        pool: wire.Pool,
        method: str,
        path: str,
        body: bytes | None,
        fresh: bool,
        deadline: float | None,
        stopper: wire.Stopper | None = None,
    ) -> None:
        self._pool, self._method, self._path, self._body = pool, method, path, body
        self._fresh, self._deadline, self._stopper = fresh, deadline, stopper

    async def __aenter__(self) -> wire.Response:
        self._response = await self._pool.send(
            self._method, self._path, self._body, fresh=self._fresh, deadline=self._deadline, stopper=self._stopper
        )
        return self._response

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.release(self._response)


async def _json_or_raise(response: wire.Response) -> JSON:
    try:
        body = orjson.loads(await response.read())
    except orjson.JSONDecodeError:
        raise UpstreamError(f"llama-server answered {response.status} with a body that is not JSON") from None
    if response.status != 200:
        raise upstream_error(body, response.status)
    if not isinstance(body, dict):
        raise UpstreamError("llama-server answered with JSON that is not an object")
    return body


def upstream_error(body: Any, status: int) -> APIError:
    """Our error for an error object from llama-server."""
    error = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    kind = error.get("type")
    message = str(error.get("message") or "llama-server failed")
    if kind == "exceed_context_size_error":
        n_prompt, n_ctx = error.get("n_prompt_tokens"), error.get("n_ctx")
        if isinstance(n_prompt, int) and isinstance(n_ctx, int):
            message = (
                f"This model's maximum context length is {n_ctx} tokens; the prompt is {n_prompt} tokens, "
                f"{n_prompt - n_ctx} more."
            )
        if isinstance(n_prompt, int) and isinstance(n_ctx, int):
            return ContextLengthExceeded(message, param="messages", tokens=n_prompt, context=n_ctx)
        return ContextLengthExceeded(message, param="messages")
    if status == 400 or kind == "invalid_request_error":
        return InvalidRequest(message)
    log.warning("llama-server error %s (%s): %s", status, kind, message)
    return UpstreamError(f"The model instance failed: {message}")


def _unreachable(exc: wire.WireError) -> UpstreamError:
    log.debug("llama-server unreachable: %s", exc)
    if isinstance(exc, wire.Unreachable):
        return InstanceUnavailable("The model instance could not be reached or closed the connection.")
    return UpstreamError("The model instance answered with a broken response.")
