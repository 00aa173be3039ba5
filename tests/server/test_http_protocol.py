"""llmserver's HTTP/1.1 protocol (`http_protocol.GatewayProtocol`) under uvicorn's server, spoken to
in raw bytes over real sockets: keep-alive, pipelining, 100-continue, chunked bodies both ways, HEAD,
flow control, timeouts, disconnects, and what it answers to what is not HTTP or to a failing app."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psutil
import pytest
import uvicorn
from starlette.requests import Request

from llmserver.api.deps import cancel_on_disconnect, scope_header
from llmserver.asgi_ext import HEADER_INDEX
from llmserver.errors import ClientClosedRequest
from llmserver.server.front import Front
from llmserver.server.http_protocol import GatewayProtocol, Limits, QuietServer, protocol_with

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@asynccontextmanager
async def serving(
    app: App,
    *,
    read_timeout: float = 10.0,
    keep_alive: int = 5,
    http: str | type[GatewayProtocol] | None = None,
    **limits: Any,
) -> AsyncIterator[int]:
    """`app` on llmserver's protocol (with these `Limits`), or on uvicorn's own `http` one."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        http=http or protocol_with(Limits(read_timeout=read_timeout, **limits)),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=keep_alive,
    )
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        server._stopping.set()
        await task


async def body_of(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers the method, path, query and body it was sent, with a Content-Length."""
    body = await body_of(receive)
    answer = b"%s %s?%s %s" % (scope["method"].encode(), scope["path"].encode(), scope["query_string"], body)
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One answer: its status line, headers and body (by Content-Length, or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, *lines = head[:-4].split(b"\r\n")
    headers = {name.lower(): value for name, value in (line.split(b": ", 1) for line in lines)}
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    body = b""
    if headers.get(b"transfer-encoding") == b"chunked":
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
    return status, headers, body


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def test_a_kept_alive_connection_answers_one_request_after_another() -> None:
    async def test() -> None:
        async with serving(echo) as port, connect(port) as (reader, writer):
            for n in range(3):
                writer.write(b"POST /v1/x%d?a=%d HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello" % (n, n))
                status, headers, body = await read_answer(reader)
                assert status == b"HTTP/1.1 200 OK"
                assert body == b"POST /v1/x%d?a=%d hello" % (n, n)
                assert headers[b"date"].endswith(b" GMT") and b"connection" not in headers

    asyncio.run(test())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def slow_first(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/first":
            await asyncio.sleep(0.2)  # the second must still wait for it
        await echo(scope, receive, send)

    async def test() -> None:
        async with serving(slow_first) as port, connect(port) as (reader, writer):
            writer.write(
                b"POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n1"
                b"POST /second HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n2"
                b"GET /third HTTP/1.1\r\nHost: t\r\n\r\n"
            )
            answers = [(await read_answer(reader))[2] for _ in range(3)]
            assert answers == [b"POST /first? 1", b"POST /second? 2", b"GET /third? "]

    asyncio.run(test())


def test_expect_100_continue_is_answered_when_the_app_reads_the_body_and_not_before() -> None:
    async def refuses_big(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/big":  # answered from the headers alone: the client need not send the body
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await echo(scope, receive, send)

    async def test() -> None:
        async with serving(refuses_big) as port:
            async with connect(port) as (reader, writer):
                writer.write(b"POST /small HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
                assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
                writer.write(b"ok")
                assert (await read_answer(reader))[2] == b"POST /small? ok"

            async with connect(port) as (reader, writer):
                writer.write(b"POST /big HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 999\r\n\r\n")
                status, _, _ = await read_answer(reader)
                assert status == b"HTTP/1.1 413 Request Entity Too Large"  # no 100 before it

    asyncio.run(test())


def test_a_chunked_request_body_arrives_whole_and_a_large_one_in_pieces() -> None:
    sizes: list[int] = []

    async def counts(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            sizes.append(len(message["body"]))
            body += message["body"]
            more = message["more_body"]
        answer = b"%d %s" % (len(body), body[-5:])
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})

    async def test() -> None:
        async with serving(counts) as port, connect(port) as (reader, writer):
            writer.write(
                b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
            )
            assert (await read_answer(reader))[2] == b"5 abcde"
            large = b"x" * 3_000_000 + b"12345"  # beyond the 64 KiB at which reading pauses
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(large))
            writer.write(large)
            await writer.drain()
            assert (await read_answer(reader))[2] == b"%d 12345" % len(large)

    asyncio.run(test())
    assert len(sizes) > 3  # the large body came in several messages


def test_an_answer_without_a_length_is_chunked_and_head_gets_no_body() -> None:
    async def streams(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one ", b"two ", b""):
            await send({"type": "http.response.body", "body": part, "more_body": bool(part)})

    async def test() -> None:
        async with serving(streams) as port, connect(port) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            _, headers, body = await read_answer(reader)
            assert headers[b"transfer-encoding"] == b"chunked" and body == b"one two "
        async with serving(echo) as port, connect(port) as (reader, writer):
            writer.write(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert b"content-length: 9\r\n" in head  # "HEAD /h? ": the length the app gave
            _, _, body = await read_answer(reader)  # the next answer follows at once: no body in between
            assert body == b"GET /after? "

    asyncio.run(test())


def test_http_1_0_closes_after_its_answer() -> None:
    async def test() -> None:
        async with serving(echo) as port, connect(port) as (reader, writer):
            writer.write(b"GET /old HTTP/1.0\r\n\r\n")
            _, headers, body = await read_answer(reader)
            assert headers[b"connection"] == b"close" and body == b"GET /old? "
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed

    asyncio.run(test())


def test_what_is_not_http_gets_a_400_and_the_connection_closes() -> None:
    async def test() -> None:
        async with serving(echo) as port, connect(port) as (reader, writer):
            writer.write(b"\x16\x03\x01 this is TLS, not HTTP\r\n\r\n")
            status, headers, body = await read_answer(reader)
            assert status == b"HTTP/1.1 400 Bad Request" and headers[b"content-type"] == b"application/json"
            assert json.loads(body)["error"] == {
                "message": "Invalid HTTP request received.", "type": "invalid_request_error", "code": 400
            }  # fmt: skip
            assert await asyncio.wait_for(reader.read(), 5) == b""

    asyncio.run(test())


def test_an_app_that_fails_before_answering_gets_a_500_and_its_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fails(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise ValueError("the app broke")

    async def test() -> None:
        async with serving(fails) as port, connect(port) as (reader, writer):
            # Where uvicorn's own protocol logs it too; its logging config (applied as the server was
            # made) has it not propagate to the root, where caplog listens.
            logging.getLogger("uvicorn.error").addHandler(caplog.handler)
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, body = await read_answer(reader)
            assert status == b"HTTP/1.1 500 Internal Server Error"
            assert json.loads(body)["error"] == {
                "message": "Internal Server Error",
                "type": "server_error",
                "code": 500,
            }
            assert headers[b"connection"] == b"close"

    try:
        asyncio.run(test())
    finally:
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    assert any("Exception in ASGI application" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_header_value_that_would_split_the_answer_is_refused() -> None:
    async def injects(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"0"), (b"x-name", b"ok\r\nset-cookie: stolen=1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def test() -> None:
        async with serving(injects) as port, connect(port) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            received = await asyncio.wait_for(reader.read(), 5)
            assert b"stolen" not in received  # nothing of it was written: the connection closed

    asyncio.run(test())


def test_the_app_hears_of_a_client_that_left_mid_answer() -> None:
    heard: asyncio.Future[dict[str, Any]] | None = None

    async def waits(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await body_of(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        assert heard is not None
        heard.set_result(await receive())  # waits until the client is gone

    async def test() -> None:
        nonlocal heard
        heard = asyncio.get_running_loop().create_future()
        async with serving(waits) as port, connect(port) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"first"), 5)
            writer.close()
            assert await asyncio.wait_for(heard, 5) == {"type": "http.disconnect"}

    asyncio.run(test())


@pytest.mark.parametrize("protocol", ["llmserver", "httptools"])
def test_work_the_app_marked_useless_without_its_client_is_cancelled_when_it_leaves(protocol: str) -> None:
    """`cancel_on_disconnect`: on our server the protocol cancels the request's task as the connection
    is lost (no watcher: `after` is far longer than the test); on another, the watcher does it."""
    outcome: asyncio.Future[str] | None = None

    async def generates(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert outcome is not None
        request = Request(scope, receive)
        after = 60.0 if protocol == "llmserver" else 0.05
        try:
            await cancel_on_disconnect(request, asyncio.sleep(3600), after=after)
        except ClientClosedRequest:
            outcome.set_result("client closed")
        except BaseException as exc:
            outcome.set_result(repr(exc))
            raise

    async def test() -> None:
        nonlocal outcome
        outcome = asyncio.get_running_loop().create_future()
        async with serving(generates, http=None if protocol == "llmserver" else "httptools") as port:
            async with connect(port) as (_, writer):
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
                await asyncio.sleep(0.2)
            assert await asyncio.wait_for(outcome, 5) == "client closed"

    asyncio.run(test())


def test_a_request_that_stops_arriving_and_an_idle_connection_are_closed(caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> tuple[float, float, float]:
        async with serving(echo, read_timeout=0.5, keep_alive=1) as port:
            loop = asyncio.get_running_loop()
            async with connect(port) as (reader, writer):
                started = loop.time()
                writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")  # 7 bytes short
                assert await asyncio.wait_for(reader.read(), 5) == b""
                stalled = loop.time() - started

            async with connect(port) as (reader, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                await read_answer(reader)
                answered = loop.time()
                assert await asyncio.wait_for(reader.read(), 5) == b""
                idle = loop.time() - answered

            async with connect(port) as (reader, writer):  # sends nothing at all
                started = loop.time()
                assert await asyncio.wait_for(reader.read(), 5) == b""
                return stalled, idle, loop.time() - started

    with caplog.at_level(logging.INFO, logger="llmserver.http_protocol"):
        stalled, idle, silent = asyncio.run(test())
    assert 0.4 < stalled < 2, stalled  # read_timeout
    assert 0.9 < idle < 2.5, idle  # keep-alive between requests (checked at most every read_timeout)
    assert 0.4 < silent < 2, silent
    assert sum("its request stopped arriving" in r.getMessage() for r in caplog.records) == 2


def test_a_stalled_pipelined_request_does_not_cut_the_answer_before_it() -> None:
    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await asyncio.sleep(1.2)  # longer than read_timeout: a long answer, its request all in
        await echo(scope, receive, send)

    async def test() -> bytes:
        async with serving(slow, read_timeout=0.5) as port, connect(port) as (reader, writer):
            writer.write(b"GET /long HTTP/1.1\r\nHost: t\r\n\r\nGET /next HTTP/1.1\r\nHost: t\r\n")  # 2nd: no end
            _, _, body = await read_answer(reader)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # then the stalled one is closed
            return body

    assert asyncio.run(test()) == b"GET /long? "


def test_a_websocket_upgrade_is_answered_as_plain_http() -> None:
    async def test() -> list[bytes]:
        async with serving(echo) as port, connect(port) as (reader, writer):
            writer.write(
                b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            )
            first = (await read_answer(reader))[2]
            writer.write(b"GET /after HTTP/1.1\r\nHost: t\r\n\r\n")  # the connection still serves HTTP
            return [first, (await read_answer(reader))[2]]

    assert asyncio.run(test()) == [b"GET /ws? ", b"GET /after? "]


async def answer_of(port: int, request: bytes) -> tuple[bytes, dict[bytes, bytes], bytes, bytes]:
    """The answer to `request` on a connection of its own, and what follows it (b"": closed)."""
    async with connect(port) as (reader, writer):
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        status, headers, body = await read_answer(reader)
        return status, headers, body, await asyncio.wait_for(reader.read(), 5)


def test_headers_beyond_the_byte_or_field_limit_are_431_and_the_connection_closes() -> None:
    big = b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    many = b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(100)) + b"\r\n"
    fits = b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(99)) + b"\r\n"

    async def test() -> list[tuple[bytes, dict[bytes, bytes], bytes, bytes]]:
        async with serving(echo, max_header_bytes=64 * 1024, max_header_count=100) as port:
            return [await answer_of(port, request) for request in (big, many)] + [
                await answer_of(port, fits + b"GET /next HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            ]

    big, many, fitting = asyncio.run(test())
    (big_status, big_headers, big_body, after_big), (many_status, _, many_body, after_many) = big, many
    assert big_status == many_status == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert big_headers[b"connection"] == b"close" and big_headers[b"content-type"] == b"application/json"
    assert json.loads(big_body)["error"] == {
        "message": "The request's headers are larger than 65536 bytes.", "type": "request_too_large", "code": 431
    }  # fmt: skip
    assert json.loads(many_body)["error"]["code"] == 431
    assert after_big == after_many == b""  # closed
    assert fitting[0] == b"HTTP/1.1 200 OK" and fitting[3].startswith(b"HTTP/1.1 200 OK")  # 101 fields: served


def test_headers_sent_slowly_are_cut_at_the_deadline_however_steadily_they_come() -> None:
    async def test() -> float:
        async with serving(echo, read_timeout=0.6) as port, connect(port) as (reader, writer):
            loop = asyncio.get_running_loop()
            started = loop.time()
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n")

            async def trickle() -> None:
                with contextlib.suppress(ConnectionError):
                    for _ in range(100):  # a byte every 0.1 s: never silent for read_timeout
                        writer.write(b"X-Slow: 1\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.1)

            feeding = asyncio.create_task(trickle())
            assert await asyncio.wait_for(reader.read(), 5) == b""
            feeding.cancel()
            return loop.time() - started

    assert 0.5 < asyncio.run(test()) < 2.0  # the head's deadline; before, it stayed open as long as bytes came


def test_a_body_below_the_minimum_rate_is_cut_and_one_above_it_is_served() -> None:
    async def test(rate_per_tick: int) -> bytes:
        async with serving(echo, read_timeout=0.5, min_body_rate=1000.0) as port, connect(port) as (reader, writer):
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2000\r\n\r\n")
            sent = 0
            with contextlib.suppress(ConnectionError):
                while sent < 2000 and not reader.at_eof():
                    piece = b"x" * min(rate_per_tick, 2000 - sent)
                    writer.write(piece)
                    await writer.drain()
                    sent += len(piece)
                    await asyncio.sleep(0.1)
            return await asyncio.wait_for(reader.read(), 5)

    assert asyncio.run(test(10)) == b""  # 100 bytes/s: closed after the grace, no answer
    assert asyncio.run(test(400)).startswith(b"HTTP/1.1 200 OK")  # 4,000 bytes/s


def test_a_request_beyond_max_connections_is_503_and_the_others_are_served() -> None:
    async def test() -> tuple[bytes, dict[bytes, bytes], bytes]:
        async with serving(echo, max_connections=2) as port, connect(port) as _, connect(port) as (reader, writer):
            writer.write(b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
            status, headers, body, after = await answer_of(port, b"GET /third HTTP/1.1\r\nHost: t\r\n\r\n")
            assert after == b""
            writer.write(b"GET /second-again HTTP/1.1\r\nHost: t\r\n\r\n")  # the ones within still serve
            assert (await read_answer(reader))[2] == b"GET /second-again? "
            return status, headers, body

    status, headers, body = asyncio.run(test())
    assert status == b"HTTP/1.1 503 Service Unavailable" and headers[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["type"] == "overloaded_error"


def test_an_answer_given_before_the_body_came_closes_the_connection() -> None:
    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b'{"error": "too large"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def test() -> tuple[dict[bytes, bytes], bytes]:
        async with serving(refuse) as port:
            request = b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 100000\r\n\r\n"
            _, headers, _, after = await answer_of(port, request)
            return headers, after

    headers, after = asyncio.run(test())
    # Before, the connection stayed open with no Connection: close, and the client's body (sent after
    # the answer) was read as its next request.
    assert headers[b"connection"] == b"close" and after == b""


def test_a_closed_connection_is_freed_without_the_garbage_collector() -> None:
    alive: weakref.WeakSet[GatewayProtocol] = weakref.WeakSet()

    class Tracked(protocol_with(Limits(max_header_bytes=2 * 1024 * 1024))):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            alive.add(self)

    header = b"X-Big: " + b"a" * (1024 * 1024) + b"\r\n"

    async def unexpected(request: Any, exc: Exception) -> Any:
        raise exc

    # The app's own outermost layer around the echo (it leaves the server's `send` in the scope).
    app = Front(
        echo, max_bytes=1024, quota=lambda: None, audit=lambda: None,  # type: ignore[arg-type, return-value]
        hot={}, api_error=unexpected, unexpected=unexpected,
    )  # fmt: skip

    async def test() -> tuple[int, int]:
        async with serving(app, http=Tracked) as port:
            for _ in range(3):  # warm up
                await answer_of(port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + header + b"\r\n")
            await asyncio.sleep(0.05)
            before = psutil.Process().memory_info().rss
            for _ in range(30):
                await answer_of(port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + header + b"\r\n")
            for _ in range(50):  # the server's side of the last connection closes after the client's
                if not alive:
                    break
                await asyncio.sleep(0.02)
            return len(alive), psutil.Process().memory_info().rss - before

    gc.disable()
    try:
        left, grown = asyncio.run(test())
    finally:
        gc.enable()
    assert left == 0  # before: every connection stayed until a full collection (Cycle ↔ protocol)
    assert grown < 8 * 1024 * 1024, grown  # before: about 1 MB more for each of the 30


def test_a_client_still_sending_a_huge_head_reads_its_431_rather_than_a_reset() -> None:
    async def test() -> bytes:
        async with serving(echo) as port, connect(port) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: ")
            with contextlib.suppress(ConnectionError):
                for _ in range(32):  # 32 MB, most of it sent after the server has answered
                    writer.write(b"a" * (1024 * 1024))
                    await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)

    answer = asyncio.run(test())
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


def test_large_answers_reach_a_slow_reader_whole_with_the_app_held_back_meanwhile() -> None:
    piece = bytes(range(256)) * 32768  # 8 MiB: more than the sockets on both sides buffer
    waited: list[float] = []

    async def large(scope: dict[str, Any], receive: Any, send: Any) -> None:
        streamed = scope["path"] == "/stream"
        headers = [] if streamed else [(b"content-length", b"%d" % (3 * len(piece)))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for n in range(3):
            started = asyncio.get_running_loop().time()
            await send({"type": "http.response.body", "body": piece, "more_body": n < 2})
            waited.append(asyncio.get_running_loop().time() - started)

    async def test() -> list[bytes]:
        bodies = []
        async with serving(large) as port, connect(port) as (reader, writer):
            for path in (b"/stream", b"/whole"):
                writer.write(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path)
                await asyncio.sleep(0.3)  # reads nothing meanwhile: the app's sends must wait
                bodies.append((await read_answer(reader))[2])
        return bodies

    assert asyncio.run(test()) == [piece * 3, piece * 3]  # chunked, then with a Content-Length
    assert max(waited) >= 0.2  # a send waited for the client's buffer to drain (flow control)


@pytest.mark.parametrize(
    "request_bytes",
    [
        # issue 54, row 5: a coding other than chunked last, whose body's length cannot be told
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: xchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        # a chunk size that overflows 64 bits, read after the app began reading the body
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF1\r\nabc\r\n",
    ],
)
@pytest.mark.parametrize("http", [None, "httptools"])
def test_a_body_of_unknown_length_or_an_overflowing_chunk_is_answered_400_and_closed(
    request_bytes: bytes, http: str | None
) -> None:
    """llmserver's protocol answers as uvicorn's own does (`http="httptools"`): 400, then the connection closes."""

    async def test() -> None:
        async with serving(echo, http=http) as port, connect(port) as (reader, writer):
            writer.write(request_bytes)
            status, _, body = await read_answer(reader)
            assert status.startswith(b"HTTP/1.1 400"), status
            if http is None:
                assert json.loads(body)["error"]["type"] == "invalid_request_error"
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed

    asyncio.run(test())


def test_the_app_reads_each_headers_first_value_by_name_as_the_server_indexed_them() -> None:
    seen: list[tuple[Any, ...]] = []

    async def reads(scope: dict[str, Any], receive: Any, send: Any) -> None:
        indexed = scope[HEADER_INDEX]
        seen.append((indexed[0] is scope["headers"], scope_header(scope, b"x-twice"), scope_header(scope, b"x-none")))
        seen.append((scope_header(scope, b"x-padded"), scope_header(scope, b"content-length")))
        await echo(scope, receive, send)

    async def test() -> None:
        async with serving(reads) as port, connect(port) as (reader, writer):
            writer.write(
                b"POST /h HTTP/1.1\r\nHost: t\r\nX-Twice: first\r\nx-twice: second\r\nX-Padded: v \t\r\n"
                b"Content-Length: 2\r\n\r\nhi"
            )
            status, _, body = await read_answer(reader)
            assert status == b"HTTP/1.1 200 OK" and body == b"POST /h? hi"

    asyncio.run(test())
    assert seen == [(True, b"first", None), (b"v", b"2")]
