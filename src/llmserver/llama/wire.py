"""HTTP/1.1 to llama-server on kept-alive connections: the least a gateway needs, and no more.

llama-server is a known peer: one request at a time per connection, a JSON or an event-stream
answer, with a length or chunked; on loopback in plain HTTP, on another host over TLS with its
certificate verified (the instance key is in every request's headers). aiohttp's client spends about 0.3 ms of
CPU a request on what this one does not need (URL objects, header multidicts, cookies, tracing,
per-request timers); on a 2-core machine that is taken from the model's threads. Here a connection
is an asyncio protocol with httptools' parser (uvicorn's, already installed) and an answer is
delivered by its callbacks: a whole body with one wake-up, a stream as its pieces arrive, or each
piece straight to a `Tap` (the relay's pump) from the callback itself.

A pool holds at most `limit` connections, busy or idle: llama-server serves a fixed number of
HTTP threads and an idle kept-alive connection holds one of them. An idle one is not reused after
`IDLE_SECONDS`. A whole-body `read` takes the body as it arrives, so any size flows; a stream read
piece by piece pauses the socket while more than `PAUSE_BYTES` wait unread (flow control).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import Protocol, cast

import httptools

from llmserver.logs import request_id

CONNECT_TIMEOUT = 5.0
# An idle kept-alive connection is not reused after this long: llama-server (cpp-httplib) closes its
# side after 5 s idle, and a request written into a connection it is closing is lost.
IDLE_SECONDS = 4.0
PAUSE_BYTES = 1 << 20  # an answer buffered past this (a slow reader) stops reading from the socket


class WireError(Exception):
    """The exchange failed below HTTP: nothing usable came back."""


class Unreachable(WireError):
    """The connection could not be made, or dropped before any answer: the request may be sent again."""


class Untrusted(Unreachable):
    """The server's TLS certificate was refused (waiting will not change it)."""


class Broken(WireError):
    """The answer began and then broke: the connection dropped before its end, or it is not HTTP."""


class TimedOut(WireError):
    """No whole answer by the request's deadline: its connection was closed (llama-server stops)."""


class Preempted(Exception):
    """The request was stopped on purpose (`Stopper.stop`): its connection is closed, which tells
    llama-server to stop generating and free the slot. Not a WireError: nothing failed."""


class Stopper:
    """Lets another task end one request early, whatever it is waiting for (a connection, the headers,
    the next piece of a stream): the pool's fair shares take a slot back this way (pool/pool.py)."""

    __slots__ = ("connection", "stopped")

    def __init__(self) -> None:
        self.connection: Connection | None = None  # while the request is sent and answered
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        if self.connection is not None:
            self.connection.preempt()


class Tap(Protocol):
    """Takes an answer's body pieces as the parser decodes them (`Response.tap`)."""

    def data(self, chunk: bytes) -> None: ...

    def stop(self, outcome: bool | BaseException) -> None: ...


class Response:
    """One answer: its status and headers once `Pool.send` returns, its body as it arrives."""

    __slots__ = ("_buffered", "_chunks", "_connection", "_error", "_tap", "_waiter", "complete", "headers", "status")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[bytes, bytes] = {}  # names in lower case
        self.complete = False  # the whole body has arrived (it may still be buffered here)
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._tap: Tap | None = None

    def at_eof(self) -> bool:
        return self.complete and not self._chunks

    async def read(self) -> bytes:
        """The whole body. What arrives is taken as it comes, so that a body larger than `PAUSE_BYTES`
        never leaves the socket paused with nobody left to resume it."""
        parts: list[bytes] = []
        while not self.complete:
            if self._chunks:
                parts.append(self._take())
            else:
                await self._wait()
        parts.append(self._take())
        return parts[-1] if len(parts) == 1 else b"".join(parts)

    async def readany(self) -> bytes:
        """What has arrived of the body since the last read, waiting for some; b"" at its end."""
        while not self._chunks and not self.complete:
            await self._wait()
        return self._take()

    def tap(self, tap: Tap | None) -> None:
        """Hand the body's pieces to `tap` from now on (what is buffered first), in the connection's
        callback; None: buffer them again. The tap is told the end (True) or the error, and is then
        detached."""
        self._tap = tap
        if tap is None:
            return
        if self._chunks:
            tap.data(self._take())
        if self._tap is tap and (self.complete or self._error is not None):
            self._tap = None
            tap.stop(self._error or True)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _take(self) -> bytes:
        chunks = self._chunks
        if not chunks:
            if self._error is not None:
                raise self._error
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        if self._buffered > PAUSE_BYTES:
            self._connection.resume()
        self._buffered = 0
        return data

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # From the connection's callbacks.

    def _data(self, chunk: bytes) -> None:
        if self._tap is not None:
            self._tap.data(chunk)
            return
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > PAUSE_BYTES:
            self._connection.pause()
        self._wake()

    def _end(self) -> None:
        self.complete = True
        tap, self._tap = self._tap, None
        if tap is not None:
            tap.stop(True)
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.complete or self._error is not None:  # the first error is the one to tell
            return
        self._error = error
        tap, self._tap = self._tap, None
        if tap is not None:
            tap.stop(error)
        self._wake()


class Connection(asyncio.Protocol):
    """One kept-alive connection; httptools calls the `on_*` methods while `data_received` feeds it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headed: asyncio.Future[None] | None = None  # the status and headers of `response` came
        self.closed = False
        self.reusable = False  # the last answer was whole and the peer keeps the connection open
        self.expiry: asyncio.TimerHandle | None = None  # the request's deadline, while it has one
        self.idle_since = 0.0  # time.monotonic() when it was last given back to its pool
        self.stopper: Stopper | None = None  # what may end its request early (`Pool.send`)
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not registered as one

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(Broken(f"not an HTTP answer: {exc}"))

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        reason = f": {exc}" if exc else ""
        self._headed(Unreachable(f"the instance closed the connection before answering{reason}"))
        if self.response is not None:
            self.response._fail(Broken(f"the instance closed the connection mid-answer{reason}"))

    def send(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None
        self.response = Response(self)
        self.reusable = False
        try:
            if len(body) < 65536:
                self.transport.write(head + body)
            else:
                self.transport.write(head)
                self.transport.write(body)  # not copied into the head
        except RuntimeError as exc:  # uvloop: the peer closed it a moment ago
            self.close()
            raise Unreachable(f"the instance closed the connection: {exc}") from None
        return self.response

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def expire(self) -> None:
        self._broken(TimedOut("no whole answer by the deadline"))

    def preempt(self) -> None:
        error = Preempted("the request was stopped to give its slot to another")
        self._headed(error)
        if self.response is not None:
            self.response._fail(error)
        self.close()

    def _broken(self, error: WireError) -> None:
        self._headed(error)
        if self.response is not None:
            self.response._fail(error)
        self.close()

    def _headed(self, error: BaseException | None = None) -> None:
        headed, self.headed = self.headed, None
        if headed is not None and not headed.done():
            if error is None:
                headed.set_result(None)
            else:
                headed.set_exception(error)

    # httptools' callbacks.

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if response is not None:
            name = name.lower()
            known = response.headers.get(name)
            # A repeated field is one list (RFC 9110 5.3): no value overwrites another.
            response.headers[name] = value if known is None else known + b", " + value

    def on_headers_complete(self) -> None:
        if self.response is None:
            self._broken(Broken("an answer to no request"))
            return
        self.response.status = self.parser.get_status_code()
        self._headed()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._data(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None:
            return
        self.reusable = self.parser.should_keep_alive()
        if not self.reusable and self.transport is not None:
            self.transport.close()
        response._end()


class Places:
    """At most `limit` requests at once: a count, and a queue only while every place is taken. (asyncio's
    Semaphore looks through its waiters on every acquire: seven Python calls a request, this one none.)"""

    __slots__ = ("_waiters", "free")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def take(self) -> bool:
        """A place now, if one is free and nobody waits for one."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """A place, in turn, once one is given back (the caller bounds the wait)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed over just as its waiter gave up: to the next one
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def give(self) -> None:
        """A place back: to the longest waiting, else free."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class Pool:
    """Connections to one llama-server (`host:port`), at most `limit` of them at once; over TLS with
    `tls` (a context that verifies the server's certificate: the instance key travels in the headers)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int,
        headers: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._head_tail = "".join(f"{k}: {v}\r\n" for k, v in {"Host": authority, **(headers or {})}.items())
        self._idle: list[Connection] = []  # the most recently used last: the likeliest still open
        self._slots = Places(limit)
        self._busy: set[Connection] = set()

    async def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        fresh: bool = False,
        deadline: float | None = None,
        stopper: Stopper | None = None,
    ) -> Response:
        """Send a request and return its answer once its status and headers came; `fresh`: on a new
        connection. The caller gives the answer back with `release`, whatever happens. Unreachable
        when the connection cannot be made or drops before the headers; Broken when they are not HTTP;
        TimedOut when the whole answer has not come by `deadline` (the loop's clock), from then on;
        Preempted once `stopper` is stopped.

        The deadline is a timer on the connection, which fails the answer's waits and closes it: an
        `asyncio.timeout` around the call would cost a few times as much on every request."""
        loop = asyncio.get_running_loop()
        if stopper is not None and stopper.stopped:
            raise Preempted("the request was stopped before it was sent")
        if not self._slots.take():
            try:
                async with asyncio.timeout_at(deadline):
                    await self._slots.wait()
            except TimeoutError:
                raise TimedOut("no connection came free by the deadline") from None
        connection = None
        try:
            connection = None if fresh else self._reuse()
            if connection is None:
                connection = await self._connect(deadline)
            self._busy.add(connection)
            head = f"{method} {path} HTTP/1.1\r\n{self._head_tail}"
            if (rid := request_id.get()) is not None:  # checked at the front: no CR or LF in it
                head += f"X-Request-Id: {rid}\r\n"
            if body is not None:
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            if stopper is not None:
                if stopper.stopped:
                    raise Preempted("the request was stopped before it was sent")
                connection.stopper, stopper.connection = stopper, connection
            headed = connection.headed = loop.create_future()
            response = connection.send(head.encode("latin-1") + b"\r\n", body or b"")
            if deadline is not None:
                connection.expiry = loop.call_at(deadline, connection.expire)
        except BaseException:
            if connection is not None:
                self._busy.discard(connection)
                connection.stopper = None
                connection.close()
            if stopper is not None:
                stopper.connection = None
            self._slots.give()
            raise
        try:
            await headed
        except BaseException:
            self.release(response)
            raise
        return response

    def release(self, response: Response) -> None:
        """The answer is done with: its connection serves again if the whole answer was read and the
        peer keeps it open; else it is closed (what tells llama-server to stop generating)."""
        connection = response._connection
        if connection.expiry is not None:
            connection.expiry.cancel()
            connection.expiry = None
        if connection.stopper is not None:
            connection.stopper.connection = None
            connection.stopper = None
        if connection not in self._busy:
            return
        self._busy.discard(connection)
        connection.response = None
        connection.headed = None
        if connection.reusable and not connection.closed and response.at_eof():
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        self._slots.give()

    async def close(self) -> None:
        for connection in [*self._idle, *self._busy]:
            connection.close()
        self._idle.clear()

    def _reuse(self) -> Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if time.monotonic() - connection.idle_since > IDLE_SECONDS:
                # The most recent is too old: so is every one before it.
                for stale in (connection, *idle):
                    stale.close()
                idle.clear()
                return None
            if not connection.closed and connection.transport is not None and not connection.transport.is_closing():
                return connection
        return None

    async def _connect(self, deadline: float | None = None) -> Connection:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + CONNECT_TIMEOUT
        try:
            async with asyncio.timeout_at(give_up if deadline is None else min(give_up, deadline)):
                if self.tls is None:
                    _, connection = await loop.create_connection(Connection, self.host, self.port)
                else:
                    _, connection = await loop.create_connection(
                        Connection, self.host, self.port, ssl=self.tls, server_hostname=self.host
                    )
        except ssl.SSLCertVerificationError as exc:
            raise Untrusted(f"could not connect to {self.host}:{self.port}: {exc}") from None
        except (OSError, TimeoutError) as exc:  # other ssl.SSLErrors are OSErrors too
            if deadline is not None and deadline < give_up and loop.time() >= deadline:
                raise TimedOut("no connection by the deadline") from None
            raise Unreachable(f"could not connect to {self.host}:{self.port}: {exc or 'timed out'}") from None
        return connection


def pool_for(
    base_url: str, *, limit: int, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None
) -> Pool:
    """A pool for an `http://host:port` or `https://host:port` address; https verifies the server's
    certificate with `tls`, else with the system's trusted authorities."""
    scheme, _, address = base_url.partition("://")
    if scheme not in ("http", "https") or not address:
        raise ValueError(f"not an HTTP address: {base_url}")
    host, _, port = address.rstrip("/").rpartition(":")
    context = None if scheme == "http" else tls or ssl.create_default_context()
    return Pool(host.strip("[]"), int(port), limit=limit, headers=headers, tls=context)
