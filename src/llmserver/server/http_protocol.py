"""The gateway's HTTP/1.1 server: its own protocol (httptools' parser) under uvicorn's server.

uvicorn's server keeps what it does well: the sockets, the lifespan, the signals, the graceful stop
(it asks each connection to `shutdown()` and waits for `server_state.tasks`), the Date header. The
connection's protocol is this one, for two reasons:

- A connection whose request stops arriving (headers without their blank line, a body shorter than
  its Content-Length) is closed once nothing has come for `read_timeout` seconds, instead of being
  held open forever (uvicorn only times out idle keep-alive connections between requests).
- It costs less per request, which the benchmark measures (`bench.instant`, and the gateway CPU per
  tiny request of `python -m bench`): no timer made and cancelled per request (one per connection
  re-arms itself when it fires), one scope dict, the body handed over without an event, the headers
  checked in two searches instead of two per header, and an answer with a Content-Length written in
  one piece, status line, headers and body (one segment for the client to read, not two).

What it does as uvicorn does: keep-alive (HTTP/1.1 unless `Connection: close`; HTTP/1.0 closes),
pipelined requests answered in order, `Expect: 100-continue` answered on the first read of the body,
the body's flow control (reading pauses beyond 64 KiB unread) and the answer's (`send` waits while
the client's buffer is full), `http.disconnect` once the client is gone or the answer is complete,
Content-Length or chunked answers (chunked when the app gives neither), HEAD without a body, 400 for
what is not HTTP, 500 for an app that fails before answering. No WebSocket and no TLS: llmserver has
no WebSocket route, and TLS is the reverse proxy's job.

One extension: work that is useless once the client has gone (a non-streamed generation) is cancelled
by this server when the connection is lost, without a task of the app's watching for the disconnect
(`api/deps.cancel_on_disconnect`). The scope's `CANCEL_ON_DISCONNECT` starts False; while the app sets
it True, losing the connection cancels the request's task and sets it to `CANCELLED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import re
import socket
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.config import Config
from uvicorn.server import ServerState

from llmserver.asgi_ext import CANCEL_ON_DISCONNECT, CANCELLED, DIRECT_WRITE, HEADER_INDEX

log = logging.getLogger("llmserver.http_protocol")  # its name before the move: log_levels name it
app_log = logging.getLogger("uvicorn.error")  # where uvicorn's own protocol logs a failing app

HIGH_WATER = 64 * 1024  # unread body bytes beyond which reading pauses (as uvicorn)
STATUS_LINE = {code.value: b"HTTP/1.1 %d %s\r\n" % (code.value, code.phrase.encode()) for code in http.HTTPStatus}
# RFC 9110 tokens for names; no control characters (a CR or LF would split the answer) in values.
INVALID_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
INVALID_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
DISCONNECT = {"type": "http.disconnect"}
LINGER = 2.0  # seconds a connection answered mid-request reads and drops what still comes, before it closes


@dataclass(frozen=True)
class Limits:
    """What one connection may cost the server (settings: request_read_timeout, max_header_bytes,
    max_header_count, min_request_body_rate, max_connections)."""

    read_timeout: float = 10.0  # silence while a request arrives; also the whole head's deadline
    max_header_bytes: int = 64 * 1024  # a request's line and headers, in all (431 beyond)
    max_header_count: int = 100  # header fields (431 beyond)
    min_body_rate: float = 1024.0  # bytes a second a body must average after a read_timeout's grace
    max_connections: int | None = None  # open connections; a request on one beyond is answered 503


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused (`status`)."""

    def __init__(self, status: int, message: str, type_: str = "request_too_large") -> None:
        self.status, self.message, self.type = status, message, type_


def error_answer(
    status: int, type_: str, message: str, *extra: tuple[bytes, bytes]
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of an answer the server gives by itself, in the app's error envelope."""
    body = json.dumps({"error": {"message": message, "type": type_, "code": status}}).encode()
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *extra], body


FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))  # the answer's headers _head reads


def status_line(status: int) -> bytes:
    return STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status


def wake_all(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


class Cycle:
    """One request and its answer: the ASGI `receive` and `send` the app is called with."""

    __slots__ = (
        "app", "chunked", "chunks", "complete", "delivered", "disconnected", "expect_continue", "head", "is_head",
        "keep_alive", "length", "more_body", "protocol", "scope", "started", "task", "transport", "unread",
        "waiters",
    )  # fmt: skip

    def __init__(self, scope: dict[str, Any], protocol: GatewayProtocol, keep_alive: bool, expect: bool) -> None:
        self.scope = scope
        self.protocol = protocol
        self.transport = protocol.transport
        self.chunks: list[bytes] = []  # the body received and not yet read
        self.unread = 0
        self.more_body = True  # until the request's end has been parsed
        self.delivered = False  # the body's last part was read
        self.waiters: list[asyncio.Future[None]] = []
        self.disconnected = False
        self.keep_alive = keep_alive
        self.expect_continue = expect
        self.started = False
        self.complete = False
        self.chunked: bool | None = None
        self.length = 0  # bytes the Content-Length still expects
        self.head = b""  # a Content-Length answer's status line and headers, written with its body
        self.is_head = scope["method"] == "HEAD"
        self.task: asyncio.Task[None] | None = None  # the app's, while it answers
        self.app: Any = None  # what answers it instead of the server's app (a refusal), if anything

    def lost(self) -> None:
        """The connection is gone: what waits hears it, and work the app marked useless now is cancelled."""
        if not self.complete:
            self.disconnected = True
            scope = self.scope
            if scope[CANCEL_ON_DISCONNECT] is True and self.task is not None:
                scope[CANCEL_ON_DISCONNECT] = CANCELLED
                self.task.cancel()
        self.wake()

    # What the parser hands over

    def body_received(self, body: bytes) -> None:
        self.chunks.append(body)
        self.unread += len(body)
        if self.unread > HIGH_WATER:
            self.protocol.pause_reading()
        self.wake()

    def ended(self) -> None:
        self.more_body = False
        self.wake()

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        wake_all(waiters)

    # ASGI

    async def receive(self) -> dict[str, Any]:
        if self.expect_continue:
            self.expect_continue = False
            if not self.transport.is_closing():
                self.transport.write(CONTINUE)
        while True:
            if self.disconnected or self.complete:
                return DISCONNECT
            self.protocol.resume_reading()
            if self.chunks or (not self.more_body and not self.delivered):
                body = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
                self.chunks = []
                self.unread = 0
                self.delivered = not self.more_body
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            await waiter

    async def send(self, message: dict[str, Any]) -> None:
        protocol = self.protocol
        if protocol.write_paused and not self.disconnected:
            await protocol.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            self.started = True
            self.expect_continue = False
            head = self._head(message["status"], message.get("headers", ()))
            if self.chunked is False and not self.is_head:
                self.head = head  # written with the body, which follows at once
            else:
                self.transport.write(head)
            return
        if self.complete:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent, after the answer was complete.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.is_head:
            pass
        elif self.chunked:
            if body:
                self.transport.write(b"%x\r\n%b\r\n%b" % (len(body), body, b"" if more else b"0\r\n\r\n"))
            elif not more:
                self.transport.write(b"0\r\n\r\n")
        else:
            self.length -= len(body)
            if self.length < 0:
                raise RuntimeError("Response content longer than Content-Length")
            if self.head:
                body, self.head = self.head + body, b""
            if body:
                self.transport.write(body)
        if not more:
            if self.length != 0 and not self.is_head:
                raise RuntimeError("Response content shorter than Content-Length")
            self.complete = True
            self.wake()
            protocol.answered(self)

    def _head(self, status: int, headers: Any) -> bytes:
        names: list[bytes] = []
        values: list[bytes] = []
        lines = [status_line(status)]
        says_close = False
        for name, value in (*self.protocol.server_state.default_headers, *headers):
            name = name.lower()
            if name not in FRAMING:
                pass
            elif name == b"content-length":
                if self.chunked is None:
                    self.length = int(value)
                    self.chunked = False
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked":
                    self.length = 0
                    self.chunked = True
            elif b"close" in [token.strip() for token in value.lower().split(b",")]:  # connection
                self.keep_alive = False
                says_close = True
            names.append(name)
            values.append(value)
            lines += (name, b": ", value, b"\r\n")
        if self.more_body:
            # Answered before the request's body was all in (a 413, a 401 before 100 Continue): what
            # is still to come of it cannot be told from the next request, so the connection ends.
            self.keep_alive = False
        # One search over all the names and one over all the values (a tab joins them: it is allowed).
        if INVALID_NAME.search(b"".join(names)):
            raise RuntimeError("Invalid HTTP header name.")
        if INVALID_VALUE.search(b"\t".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        if not self.keep_alive and not says_close:
            lines.append(b"connection: close\r\n")
        if self.chunked is None and not self.is_head and status not in (204, 304):
            self.chunked = True  # neither Content-Length nor Transfer-Encoding
            lines.append(b"transfer-encoding: chunked\r\n")
        if self.chunked is None:
            self.chunked = False
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send_error(self, status: int, type_: str, message: str, *extra: tuple[bytes, bytes]) -> None:
        self.keep_alive = False
        headers, body = error_answer(status, type_, message, *extra)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def overloaded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """What answers a request on a connection beyond `max_connections`, instead of the app."""
        message = "The server has too many open connections; try again shortly."
        await self.send_error(503, "overloaded_error", message, (b"retry-after", b"1"))


def direct_writer(send: Any) -> DirectWriter | None:
    """The `DIRECT_WRITE` extension (`asgi_ext`): for this server's `send` of a started chunked answer,
    a writer of its body chunks straight to the connection; None for any other. A function of the
    module, not of the request: nothing in the scope points back at the connection."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not Cycle or not cycle.started or cycle.chunked is not True or cycle.complete or cycle.is_head:
        return None
    return DirectWriter(cycle)


class DirectWriter:
    """Writes a started chunked answer's body chunks straight to the connection's transport, framed
    as `Cycle.send` frames them, from any callback (the relay's pump). It says False once the client
    is gone (and writes nothing) or the connection's buffer is full (flow control; what it was given
    is written all the same): the app then goes back to sending, and awaiting, through `send`."""

    __slots__ = ("_cycle", "_write")

    def __init__(self, cycle: Cycle) -> None:
        self._cycle = cycle
        self._write = cycle.transport.write

    def __call__(self, body: bytes) -> bool:
        cycle = self._cycle
        if cycle.disconnected or cycle.complete:
            return False
        self._write(b"%x\r\n%b\r\n" % (len(body), body))  # written even when paused: nothing is dropped
        return not cycle.protocol.write_paused


class GatewayProtocol(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    limits: Limits = Limits()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any], _loop: Any = None) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_running_loop()
        self.server_state = server_state
        self.connections = server_state.connections
        self.tasks = server_state.tasks
        self.app_state = app_state
        self.root_path = config.root_path
        self.keep_alive_timeout = float(config.timeout_keep_alive)
        self.limit_concurrency = config.limit_concurrency  # uvicorn's setting, honoured as uvicorn does
        self.read_timeout = self.limits.read_timeout
        self.asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            # Answer the first of pipelined requests even when the client closes its side after sending.
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.cycle: Cycle | None = None  # the request being parsed (or the last one)
        self.running: Cycle | None = None  # the request the app is answering
        self.pipeline: deque[Cycle] = deque()  # requests parsed while another was being answered
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect = False
        self.read_paused = False
        self.write_paused = False
        self.drained: list[asyncio.Future[None]] = []
        # The head's bytes and fields, counted before the parser sees them (its cost grows with the
        # square of a header's size): beyond the limits the request is answered 431 unparsed.
        self.heading = True  # what arrives is a request's line and headers (or what comes before one)
        self.head_bytes = 0
        self.discarding = False  # answered mid-request: what comes is dropped until the close
        # The one timer: closes a connection whose request stopped arriving or arrives too slowly
        # (read_timeout: of silence, for the whole head, then the body's minimum rate), or that sat
        # idle between requests (uvicorn's timeout_keep_alive); it re-arms itself when it fires early.
        self.reading = True  # a new connection waits for its first request
        self.last = 0.0  # when data last came, or the last answer ended
        self.began = 0.0  # when the request being read began (its first byte, or its body's start)
        self.body_bytes = 0  # of the request being read, since its head ended
        self.timer: asyncio.TimerHandle | None = None

    # The connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connections.add(self)  # type: ignore[arg-type]  # uvicorn types its own protocols only
        self.transport = transport  # type: ignore[assignment]  # a stream transport (TCP)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.last = self.began = self.loop.time()
        self.timer = self.loop.call_later(self.read_timeout, self._check_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        for cycle in (self.running, self.cycle, *self.pipeline):
            if cycle is not None:
                cycle.lost()
        # Nothing of the connection stays referenced from here: its requests (which point back at it)
        # are let go, so that it is freed at once rather than by the next full garbage collection.
        self.running = self.cycle = None
        self.pipeline.clear()
        self.write_paused = False
        self._drained()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        pass  # a half-closed client still gets its answer (the transport closes once it is written)

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return  # an answer was given and the connection is closing (`_linger`)
        self.last = self.loop.time()
        try:
            if self.heading and self.head_bytes + len(data) > self.limits.max_header_bytes:
                # Only what may still be head goes to the parser; the rest once the head has ended.
                room = self.limits.max_header_bytes - self.head_bytes
                self.head_bytes += room
                self.parser.feed_data(data[:room])
                if self._heading():  # the parser's callbacks say whether the head ended in it
                    raise _Refused(431, f"The request's headers are larger than {self.limits.max_header_bytes} bytes.")
                data = data[room:]
            elif self.heading:
                self.head_bytes += len(data)
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket here: the request is answered as plain HTTP
        except _Refused as refused:
            self._refuse(refused)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Refused):  # raised in a callback, wrapped by the parser
                self._refuse(exc.__context__)
                return
            log.info("answering 400 to %s: what it sent is not an HTTP/1.1 request", self._who())
            self._send_error(400, "invalid_request_error", "Invalid HTTP request received.")

    @property
    def scope(self) -> dict[str, Any] | None:
        """The scope of the request read last (as uvicorn's protocols have it)."""
        return None if self.cycle is None else self.cycle.scope

    def _heading(self) -> bool:
        return self.heading

    def _refuse(self, refused: _Refused) -> None:
        log.info("answering %d to %s: %s", refused.status, self._who(), refused.message)
        self._send_error(refused.status, refused.type, refused.message)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._drained()

    async def drain(self) -> None:
        waiter = self.loop.create_future()
        self.drained.append(waiter)
        await waiter

    def _drained(self) -> None:
        waiters, self.drained = self.drained, []
        wake_all(waiters)

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else once the answer under way is complete."""
        if self.running is None:
            self.transport.close()
        else:
            self.running.keep_alive = False
            for cycle in self.pipeline:
                cycle.keep_alive = False

    # The parser's callbacks

    def on_message_begin(self) -> None:
        self.reading = True  # a request began: its first byte came
        self.began = self.loop.time()
        self.url = b""
        self.headers = []
        self.expect = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        # httptools keeps a value's trailing spaces and tabs, which are not part of it (RFC 9110, 5.5).
        headers.append((name.lower(), value.rstrip(b" \t")))
        if len(headers) > self.limits.max_header_count:
            raise _Refused(431, f"The request has more than {self.limits.max_header_count} header fields.")

    def on_headers_complete(self) -> None:
        headers = self.headers
        index = dict(reversed(headers))  # each name's first value (asgi_ext.HEADER_INDEX)
        if b"transfer-encoding" in index or b"expect" in index:
            for name, value in headers:
                # A body whose length cannot be told (RFC 9112 6.3: chunked is not the final coding):
                # refused, as uvicorn does, rather than read as a body that ends with the connection.
                if name == b"transfer-encoding" and value.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
                    raise _Refused(400, "Unsupported Transfer-Encoding: only chunked is read.", "invalid_request_error")
                if name == b"expect" and value.lower() == b"100-continue":
                    self.expect = True
        self.heading = False
        self.began = self.loop.time()  # from here the body's rate counts
        self.body_bytes = 0
        parser = self.parser
        version = parser.get_http_version()
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": self.asgi,
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "root_path": self.root_path,
            "headers": headers,
            HEADER_INDEX: (headers, index),
            "state": self.app_state.copy() if self.app_state else {},
            "method": parser.get_method().decode("ascii"),
            "path": self.root_path + path,
            "raw_path": self.root_path.encode("ascii") + raw_path if self.root_path else raw_path,
            "query_string": url.query or b"",
            CANCEL_ON_DISCONNECT: False,
        }
        cycle = self.cycle = Cycle(scope, self, version != "1.0" and parser.should_keep_alive(), self.expect)
        scope["extensions"] = {DIRECT_WRITE: direct_writer}
        limit, uvicorns = self.limits.max_connections, self.limit_concurrency
        if (limit is not None and len(self.connections) > limit) or (
            uvicorns is not None and (len(self.connections) >= uvicorns or len(self.tasks) >= uvicorns)
        ):
            cycle.app = cycle.overloaded
        if self.running is None:
            self._start(cycle)
        else:
            self.pause_reading()  # pipelined: answered once the one before is
            self.pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        cycle = self.cycle
        if cycle is not None and not cycle.complete:
            cycle.body_received(body)

    def on_message_complete(self) -> None:
        self.reading = False
        self.heading = True
        self.head_bytes = 0
        cycle = self.cycle
        if cycle is not None and not cycle.complete:
            cycle.ended()

    # Answering

    def _start(self, cycle: Cycle) -> None:
        self.running = cycle
        task = cycle.task = self.loop.create_task(self._run(cycle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, cycle: Cycle) -> None:
        try:
            returned = await (cycle.app or self.app)(cycle.scope, cycle.receive, cycle.send)
        except BaseException as exc:
            app_log.error("Exception in ASGI application\n", exc_info=exc)
            if not cycle.started:
                await cycle.send_error(500, "server_error", "Internal Server Error")
            else:
                self.transport.close()
        else:
            if returned is not None:  # not an ASGI application: what else it did is not to be trusted
                app_log.error("ASGI callable should return None, but returned '%s'.", returned)
                if not self.transport.is_closing():
                    self.transport.close()
            elif not cycle.started and not cycle.disconnected:
                app_log.error("ASGI callable returned without starting response.")
                await cycle.send_error(500, "server_error", "Internal Server Error")
            elif not cycle.complete and not cycle.disconnected:
                app_log.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            cycle.task = None
            if self.running is cycle and not cycle.complete:
                self.running = None  # the connection is closing: nothing follows

    def answered(self, cycle: Cycle) -> None:
        """`cycle`'s answer is complete: the next request's turn, or the connection's end."""
        self.server_state.total_requests += 1
        if self.running is cycle:
            self.running = None
        if not cycle.keep_alive:
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        self.last = self.loop.time()
        if self.pipeline:
            self._start(self.pipeline.popleft())
        if not self.pipeline:
            self.resume_reading()

    def _check_timeout(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        running = self.running
        receiving_body = running is not None and running is self.cycle and running.more_body and self.reading
        if running is not None and not receiving_body:
            # Answering, its body all in (what may be arriving is a pipelined request, read once this
            # answer is done): no limit here, request_timeout is the app's.
            self.timer = self.loop.call_later(min(self.read_timeout, self.keep_alive_timeout), self._check_timeout)
            return
        now = self.loop.time()
        limit = self.read_timeout if self.reading else self.keep_alive_timeout
        waited = now - self.last
        # The whole head within read_timeout of its first byte; the body at min_body_rate on average
        # after a read_timeout's grace. Silence for read_timeout ends either.
        if not self.reading:
            deadline = self.last + limit
        elif receiving_body:
            deadline = min(self.last + limit, self.began + limit + self.body_bytes / self.limits.min_body_rate)
        else:
            deadline = min(self.last + limit, self.began + limit)
        if now < deadline:
            self.timer = self.loop.call_later(deadline - now, self._check_timeout)
            return
        if self.reading:
            what = "stopped arriving" if waited >= limit else "arrives too slowly"
            log.info("closing the connection from %s: its request %s (%.0f s)", self._who(), what, now - self.began)
        self.transport.close()

    def _send_error(self, status: int, type_: str, message: str) -> None:
        """An answer of the server's own, before any app saw the request; the connection closes."""
        running = self.running
        if running is not None:
            if running.started:  # an answer is being written: nothing may cut into it
                self.transport.close()
                return
            # The app is reading a body that turned out malformed (a chunk size that overflows): it hears
            # the client gone, and the client hears why.
            running.lost()
        headers, body = error_answer(status, type_, message, (b"connection", b"close"))
        lines = [status_line(status)]
        for name, value in (*self.server_state.default_headers, *headers):
            lines += (name, b": ", value, b"\r\n")
        lines += (b"\r\n", body)
        self.transport.write(b"".join(lines))
        self._linger()

    def _linger(self) -> None:
        """Close after an answer given mid-request: our side is shut once the answer is written, and
        what the client still sends is read and dropped for up to `LINGER` seconds (or until it closes).
        Closing at once with its bytes unread would reset the connection, and a client still sending
        (a 48 MB header) would never read the answer."""
        try:
            half_close = self.transport.can_write_eof()
        except (AttributeError, NotImplementedError):  # a transport that cannot (a test's stand-in)
            half_close = False
        if not half_close:
            self.transport.close()
            return
        self.discarding = True
        self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple | list) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def protocol_with(limits: Limits) -> type[GatewayProtocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type("GatewayProtocol", (GatewayProtocol,), {"limits": limits})


class QuietServer(uvicorn.Server):
    """uvicorn's server, whose main loop wakes ten times a second to refresh the Date header (once a
    second) and to see whether a stop was asked for: here it wakes once a second, and a stop signal
    wakes it at once. Each wake-up of an idle process costs it 0.1 to 0.2 ms of CPU on this kind of VM."""

    TICK = 1.0  # seconds
    on_started: Callable[[], None] | None = None  # once the app has started and the port listens
    on_exit: Callable[[], None] | None = None  # when a stop signal arrives

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    async def main_loop(self) -> None:
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while not await self.on_tick(0):  # a multiple of 10: every tick refreshes the Date header
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.TICK):
                    await self._stopping.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_exit is not None and not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)
        if hasattr(self, "_loop"):  # the signal handler runs between bytecodes: wake the loop safely
            self._loop.call_soon_threadsafe(self._stopping.set)
