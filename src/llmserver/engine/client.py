"""An HTTP client for one llama-server instance: JSON calls and server-sent-event streams.

llama-server's own errors are mapped to our envelope by their structured `type`, never by text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from llmserver.errors import (
    APIError,
    ContextLengthExceeded,
    GatewayTimeout,
    InstanceUnavailable,
    InvalidRequest,
    UpstreamError,
)

log = logging.getLogger(__name__)

JSON = dict[str, Any]
JSON_BODY = {"Content-Type": "application/json"}


class LlamaServerClient:
    def __init__(self, base_url: str, *, connections: int = 8, api_key: str | None = None) -> None:
        self.base_url = base_url
        # An instance on a worker host answers only to the key that gateways and its node share.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        connector = aiohttp.TCPConnector(limit=connections, force_close=False, enable_cleanup_closed=True)
        # No total timeout here: callers bound whole generations themselves.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0), headers=headers
        )
        # Retries go out on a new connection: llama-server may have closed the kept-alive ones the
        # pool still holds (it does so right after a streamed answer), and a second stale one would
        # fail the request for nothing.
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            headers=headers,
        )

    async def close(self) -> None:
        await self._session.close()
        await self._fresh.close()

    async def healthy(self, timeout: float = 2.0) -> bool:
        try:
            async with self._session.get(
                self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def get_json(self, path: str) -> JSON:
        try:
            async with self._session.get(self.base_url + path) as response:
                return await _json_or_raise(response)
        except aiohttp.ClientError as exc:
            raise _unreachable(exc) from None

    @asynccontextmanager
    async def _post(self, path: str, payload: JSON, fresh: bool = False) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST once. A connection that drops before any answer (llama-server may close connections
        just after a streamed answer ends) is InstanceUnavailable, which the one retry policy
        (`engine/calls.py`) sends again."""
        session = self._fresh if fresh else self._session
        response = await session.post(self.base_url + path, data=orjson.dumps(payload), headers=JSON_BODY)
        try:
            yield response
        finally:
            # Read to the end: the connection may serve again. Left early: closing it is what
            # tells llama-server to stop generating.
            if response.content.at_eof():
                response.release()
            else:
                response.close()

    async def post_json(self, path: str, payload: JSON, *, fresh: bool = False, timeout: float | None = None) -> JSON:
        """POST and read the JSON answer within `timeout` seconds (GatewayTimeout past it); `fresh`:
        on a new connection (a retry)."""
        try:
            async with asyncio.timeout(timeout), self._post(path, payload, fresh) as response:
                return await _json_or_raise(response)
        except aiohttp.ClientError as exc:
            raise _unreachable(exc) from None
        except TimeoutError:
            raise _past(timeout) from None

    async def stream(
        self, path: str, payload: JSON, *, fresh: bool = False, timeout: float | None = None
    ) -> AsyncGenerator[list[bytes], Sink | None]:
        """POST with `stream: true` and yield the events' data (JSON text, unparsed: the relay parses
        only what it must) until `[DONE]`, as they arrived: one list per read from the socket (several
        when llama-server wrote them at once), so that the relay writes them to its client in one
        piece, and wakes up once for them. An error event raises. The whole stream is bounded by
        `timeout` seconds (GatewayTimeout past it).

        A `Sink` sent in (`asend`) takes the rest of the events instead, pumped from the socket's own
        callback (`_pump`); they are yielded again once it asks to stop (its client is slow).

        Leaving the iteration early (a client that went away) closes the connection, which makes
        llama-server stop generating and free the slot.
        """
        try:
            async with asyncio.timeout(timeout), self._post(path, payload, fresh) as response:
                if response.status != 200:
                    await _json_or_raise(response)
                content = response.content
                pumpable = type(content) is aiohttp.StreamReader
                events = EventSplitter()
                sink: Sink | None = None
                while not events.done:
                    if sink is not None and pumpable:
                        if await _pump(content, events, sink):
                            return
                        sink = None  # it asked to stop: yield again until another is sent
                    chunk = await content.readany()
                    if not chunk:
                        return
                    batch = events.feed(chunk)
                    if batch:
                        sink = yield batch
        except orjson.JSONDecodeError:
            raise UpstreamError("The model instance answered with a broken response.") from None
        except aiohttp.ClientError as exc:
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
    parser decodes each piece: no buffer, no task woken per token. It stops (`stopped`) with True at
    the stream's end, with False when the sink asks (the rest is read as usual), or with the error."""

    def __init__(self, reader: aiohttp.StreamReader, events: EventSplitter, sink: Sink) -> None:
        self.reader, self.events, self.sink = reader, events, sink
        self.stopped: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

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
        self.reader.__class__ = aiohttp.StreamReader  # what arrives from now on is buffered as usual
        if self.stopped.done():
            return
        if isinstance(outcome, BaseException):
            self.stopped.set_exception(outcome)
        else:
            self.stopped.set_result(outcome)


_PUMPS: dict[int, _Pump] = {}  # by id() of the reader being pumped


class _PumpedReader(aiohttp.StreamReader):
    """A response body whose data goes to its pump rather than into the buffer: aiohttp's parser calls
    `feed_data`, `feed_eof` and `set_exception` on it. Same layout as StreamReader, whose class a
    reader takes for a pump's time (`_pump`) and gets back after."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        _PUMPS[id(self)].data(data)
        return False

    def feed_eof(self) -> None:
        super().feed_eof()
        _PUMPS[id(self)].stop(True)

    def set_exception(self, exc: BaseException, *cause: BaseException) -> None:
        super().set_exception(exc, *cause)
        _PUMPS[id(self)].stop(exc)


async def _pump(reader: aiohttp.StreamReader, events: EventSplitter, sink: Sink) -> bool:
    """The rest of a response's events pumped to `sink`: True once the stream has ended, False when
    the sink asked to stop (read on as usual); the connection's error raises."""
    pump = _Pump(reader, events, sink)
    buffered = reader.read_nowait()  # what came before the pump
    _PUMPS[id(reader)] = pump
    reader.__class__ = _PumpedReader
    try:
        if buffered:
            pump.data(buffered)
        if reader.is_eof():
            pump.stop(True)
        return await pump.stopped
    finally:
        reader.__class__ = aiohttp.StreamReader
        del _PUMPS[id(reader)]


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


async def _json_or_raise(response: aiohttp.ClientResponse) -> JSON:
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
                f"The prompt is {n_prompt} tokens, {n_prompt - n_ctx} more than the model's context of {n_ctx} tokens."
            )
        return ContextLengthExceeded(message, param="messages")
    if status == 400 or kind == "invalid_request_error":
        return InvalidRequest(message)
    log.warning("llama-server error %s (%s): %s", status, kind, message)
    return UpstreamError(f"The model instance failed: {message}")


def _unreachable(exc: aiohttp.ClientError) -> UpstreamError:
    log.debug("llama-server unreachable: %s", exc)
    if isinstance(exc, aiohttp.ClientConnectionError):
        return InstanceUnavailable("The model instance could not be reached or closed the connection.")
    return UpstreamError("The model instance answered with a broken response.")
