"""The lean HTTP/1.1 client (`llama/wire.py`) against real servers on 127.0.0.1: a raw asyncio server
that answers each request as a test scripts it (lengths, chunks, `Connection: close`, drops, noise),
and the real llama-server for the calls the gateway makes."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from llmserver.errors import GatewayTimeout, InstanceUnavailable, UpstreamError
from llmserver.llama import wire
from llmserver.llama.client import LlamaServerClient
from tests.support import free_port, tls_certificates

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # the request's head → keep the connection?


class Server:
    """Answers each request with `answer`; counts connections and requests, keeps their heads."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.heads: list[bytes] = []
        self.closed = asyncio.Event()  # a connection was closed by the client
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                self.heads.append(head)
                if not await self.answer(head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            self.open -= 1
            writer.close()


@asynccontextmanager
async def serving(answer: Answer, *, limit: int = 8) -> AsyncIterator[tuple[Server, wire.Pool]]:
    server = Server(answer)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    pool = wire.pool_for(f"http://127.0.0.1:{server.port}", limit=limit, headers={"Authorization": "Bearer k"})
    try:
        yield server, pool
    finally:
        await pool.close()
        listener.close()
        await listener.wait_closed()


def json_answer(body: bytes = b'{"ok":true}', *, close: bool = False) -> Answer:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        extra = b"Connection: close\r\n" if close else b""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body))
        await writer.drain()
        return not close

    return answer


async def cut(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """The answer begins, then the connection drops."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    return False


async def exchange(pool: wire.Pool, path: str = "/x", body: bytes | None = b"{}") -> tuple[int, bytes]:
    response = await pool.send("POST" if body is not None else "GET", path, body)
    try:
        return response.status, await response.read()
    finally:
        pool.release(response)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_answers_are_read_whole_and_the_connection_serves_again() -> None:
    async def test() -> None:
        async with serving(json_answer()) as (server, pool):
            for _ in range(3):
                assert await exchange(pool) == (200, b'{"ok":true}')
            assert await exchange(pool, "/health", None) == (200, b'{"ok":true}')
            assert server.connections == 1
            first = server.heads[0].decode()
            assert first.startswith("POST /x HTTP/1.1\r\n")
            assert f"Host: 127.0.0.1:{server.port}\r\n" in first
            assert "Authorization: Bearer k\r\n" in first and "Content-Length: 2\r\n" in first
            assert "Content-Length" not in server.heads[3].decode()  # a GET has no body

    run(test)


def test_chunked_answers_arrive_piece_by_piece() -> None:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"one", b"two"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        return True

    async def test() -> None:
        async with serving(answer) as (server, pool):
            response = await pool.send("POST", "/s", b"{}")
            assert response.headers[b"content-type"] == b"text/event-stream"
            pieces = []
            while piece := await response.readany():
                pieces.append(piece)
            assert pieces == [b"one", b"two"] and response.at_eof()
            pool.release(response)
            assert await exchange(pool) is not None and server.connections == 1

    run(test)


def test_connection_close_is_honoured() -> None:
    async def test() -> None:
        async with serving(json_answer(close=True)) as (server, pool):
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert server.connections == 2

    run(test)


def test_a_kept_alive_connection_the_server_closed_is_not_reused() -> None:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        await json_answer()(head, writer)
        return False  # closes it after answering, as llama-server does after its keep-alive timeout

    async def test() -> None:
        async with serving(answer) as (server, pool):
            assert await exchange(pool) == (200, b'{"ok":true}')
            await asyncio.sleep(0.05)  # the close has reached the client
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert server.connections == 2

    run(test)


def test_a_body_left_unread_closes_its_connection() -> None:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(250):  # a generation still going, until its writes fail
            writer.write(b"3\r\none\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
        return True

    async def test() -> None:
        async with serving(answer) as (server, pool):
            response = await pool.send("POST", "/s", b"{}")
            assert (await response.readany()).startswith(b"one")
            pool.release(response)  # the client went away
            await asyncio.wait_for(server.closed.wait(), 2)  # what makes llama-server stop generating

    run(test)


def test_a_drop_before_the_answer_is_unreachable_and_after_it_broken() -> None:
    async def drop(head: bytes, writer: asyncio.StreamWriter) -> bool:
        return False

    async def test() -> None:
        async with serving(drop) as (_, pool):
            with pytest.raises(wire.Unreachable):
                await pool.send("POST", "/x", b"{}")
        async with serving(cut) as (_, pool):
            response = await pool.send("POST", "/x", b"{}")
            with pytest.raises(wire.Broken, match="mid-answer"):
                await response.read()
            pool.release(response)

    run(test)


def test_an_answer_that_is_not_http_is_broken() -> None:
    async def noise(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        return await asyncio.sleep(1, False)

    async def test() -> None:
        async with serving(noise) as (_, pool):
            with pytest.raises(wire.Broken, match="not an HTTP answer"):
                await pool.send("GET", "/health")

    run(test)


def test_nothing_listening_is_unreachable() -> None:
    async def test() -> None:
        pool = wire.pool_for(f"http://127.0.0.1:{free_port()}", limit=2)
        with pytest.raises(wire.Unreachable, match="could not connect"):
            await pool.send("GET", "/health")
        await pool.close()

    run(test)


def test_no_more_than_limit_connections_at_once() -> None:
    async def slow(head: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        return await json_answer()(head, writer)

    async def test() -> None:
        async with serving(slow, limit=2) as (server, pool):
            answers = await asyncio.gather(*(exchange(pool) for _ in range(6)))
            assert answers == [(200, b'{"ok":true}')] * 6
            assert server.most_open == 2 and server.connections == 2

    run(test)


def test_places_go_in_turn_and_one_handed_to_a_waiter_that_gave_up_goes_to_the_next() -> None:
    async def test() -> None:
        places = wire.Places(1)
        assert places.take() and not places.take()
        first, second, third = (asyncio.create_task(places.wait()) for _ in range(3))
        await asyncio.sleep(0)  # one turn of the loop: each task runs to its wait
        assert places.waiting == 3
        third.cancel()  # gave up while queued: leaves the line
        with pytest.raises(asyncio.CancelledError):
            await third
        places.give()  # to the first in line ...
        first.cancel()  # ... which gives up before it runs: the place goes on to the second
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 5)
        assert places.waiting == 0 and not places.take()  # the second holds the only place
        places.give()
        assert places.take()

    run(test)


def test_a_slow_reader_pauses_the_socket_and_gets_every_byte() -> None:
    body = bytes(range(256)) * (3 * wire.PAUSE_BYTES // 256)  # three times what is buffered before a pause

    async def test() -> None:
        async with serving(json_answer(body)) as (_, pool):
            response = await pool.send("POST", "/big", b"{}")
            received = b""
            await asyncio.sleep(0.2)  # all of it could have arrived by now: only about PAUSE_BYTES did
            while piece := await response.readany():
                assert len(piece) <= 2 * wire.PAUSE_BYTES
                received += piece
            pool.release(response)
            assert received == body

    run(test)


def test_the_client_maps_wire_failures_to_the_envelope() -> None:
    async def test() -> None:
        client = LlamaServerClient(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(InstanceUnavailable):  # sent again by the retry policy
            await client.post_json("/v1/completions", {})
        assert not await client.healthy()
        await client.close()
        async with serving(cut) as (server, _):
            client = LlamaServerClient(f"http://127.0.0.1:{server.port}")
            with pytest.raises(UpstreamError, match="broken response"):  # never sent again
                await client.post_json("/v1/completions", {})
            await client.close()

    run(test)


def test_a_call_past_its_timeout_is_504_and_its_connection_closed() -> None:
    """Silent before the headers, or stalled mid-body: either way the deadline's timer ends the call
    and closes the connection (what stops llama-server); the pool serves the next call."""
    replied = False

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal replied
        if b"/silent" in head:
            await asyncio.sleep(3600)
        if b"/stalled" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
            await asyncio.sleep(3600)
        replied = True
        return await json_answer()(head, writer)

    async def test() -> None:
        async with serving(answer, limit=1) as (server, _):
            client = LlamaServerClient(f"http://127.0.0.1:{server.port}", connections=1)
            for path in ("/silent", "/stalled"):
                started = asyncio.get_running_loop().time()
                with pytest.raises(GatewayTimeout, match="within 0 s"):
                    await client.post_json(path, {}, timeout=0.3)
                assert 0.3 <= asyncio.get_running_loop().time() - started < 1.0
                assert not client._pool._busy and not client._pool._idle  # closed, its slot given back
            assert await client.post_json("/ok", {}, timeout=5) == {"ok": True}
            assert replied and server.connections == 3  # one per call: neither timed-out one was reused
            await client.close()

    run(test)


def test_a_call_waiting_for_a_connection_past_its_timeout_is_504() -> None:
    async def test() -> None:
        async with serving(json_answer(), limit=1) as (server, _):
            client = LlamaServerClient(f"http://127.0.0.1:{server.port}", connections=1)
            held = await client._pool.send("POST", "/held", b"{}")  # the one connection, kept busy
            with pytest.raises(GatewayTimeout):
                await client.post_json("/x", {}, timeout=0.2)
            client._pool.release(held)
            assert await client.post_json("/x", {}, timeout=5) == {"ok": True}
            await client.close()

    run(test)


def test_addresses() -> None:
    pool = wire.pool_for("http://[::1]:8081", limit=1)
    assert (pool.host, pool.port) == ("::1", 8081)
    assert "Host: [::1]:8081\r\n" in pool._head_tail
    secure = wire.pool_for("https://example.com:443", limit=1)
    assert (secure.host, secure.port) == ("example.com", 443) and secure.tls is not None
    assert secure.tls.verify_mode == ssl.CERT_REQUIRED and secure.tls.check_hostname
    with pytest.raises(ValueError, match="not an HTTP address"):
        wire.pool_for("ftp://example.com:21", limit=1)


def test_a_whole_answer_three_times_the_pause_threshold_is_read_without_a_stall() -> None:
    body = bytes(range(256)) * (3 * wire.PAUSE_BYTES // 256)

    async def test() -> None:
        async with serving(json_answer(body)) as (server, pool):
            deadline = asyncio.get_running_loop().time() + 10
            response = await pool.send("POST", "/big", b"{}", deadline=deadline)
            try:
                assert await response.read() == body  # stalled until the deadline before (TimedOut)
            finally:
                pool.release(response)
            assert await exchange(pool) is not None and server.connections == 1  # read whole: reused

    run(test)


def test_a_large_chunked_answer_is_read_whole_too() -> None:
    piece = bytes(range(256)) * 1024  # 256 KiB a chunk, 12 of them: three times the pause threshold

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(12):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    async def test() -> None:
        async with serving(answer) as (_, pool):
            response = await pool.send("GET", "/big", deadline=asyncio.get_running_loop().time() + 10)
            try:
                assert await response.read() == piece * 12
            finally:
                pool.release(response)

    run(test)


def test_repeated_header_fields_are_joined_not_overwritten() -> None:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nVary: a\r\nvary: b\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    async def test() -> None:
        async with serving(answer) as (_, pool):
            response = await pool.send("GET", "/h")
            await response.read()
            pool.release(response)
            assert response.headers[b"vary"] == b"a, b"

    run(test)


def test_an_idle_connection_past_its_time_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "IDLE_SECONDS", 0.05)

    async def test() -> None:
        async with serving(json_answer()) as (server, pool):
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert server.connections == 1  # reused while fresh
            await asyncio.sleep(0.1)  # the idle connection's time passes (what is tested is a time)
            assert await exchange(pool) == (200, b'{"ok":true}')
            assert server.connections == 2
            await asyncio.wait_for(server.closed.wait(), 2)  # the stale one was closed, not leaked

    run(test)


def test_https_verifies_the_instance_certificate_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    ca, cert, key = tls_certificates(tmp_path / "ok", ["127.0.0.1"])
    other_ca, _, _ = tls_certificates(tmp_path / "other", ["127.0.0.1"])
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)

    async def test() -> None:
        server = Server(json_answer())
        listener = await asyncio.start_server(server._serve, "127.0.0.1", 0, ssl=served)
        url = f"https://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        trusted = wire.pool_for(url, limit=2, tls=ssl.create_default_context(cafile=str(ca)))
        stranger = wire.pool_for(url, limit=2, tls=ssl.create_default_context(cafile=str(other_ca)))
        try:
            assert await exchange(trusted) == (200, b'{"ok":true}')
            assert await exchange(trusted) == (200, b'{"ok":true}')
            assert server.connections == 1  # kept alive over TLS too
            with pytest.raises(wire.Untrusted, match="CERTIFICATE_VERIFY_FAILED"):  # an Unreachable
                await exchange(stranger)
        finally:
            await trusted.close()
            await stranger.close()
            listener.close()
            await listener.wait_closed()

    run(test)


def test_a_stopped_stream_raises_preempted_wherever_it_waits_and_its_connection_closes() -> None:
    """`Stopper.stop()` from another task ends a stream before its headers, mid-body (also while a pump
    takes the events), or before it is sent at all: wire.Preempted (not an instance failure), the
    connection closed (what tells llama-server to stop generating) and never reused."""

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if b"/silent" in head:
            await asyncio.sleep(3600)
        if b"/stream" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            event = b'data: {"choices":[{"text":"x"}]}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(3600)
        return await json_answer()(head, writer)

    async def test() -> None:
        async with serving(answer) as (server, _):
            client = LlamaServerClient(f"http://127.0.0.1:{server.port}")
            loop = asyncio.get_running_loop()
            stopper = wire.Stopper()
            loop.call_later(0.2, stopper.stop)
            with pytest.raises(wire.Preempted):
                await anext(client.stream("/silent", {}, stopper=stopper))  # waiting for the headers
            assert stopper.connection is None and not client._pool._busy and not client._pool._idle

            for pumped in (False, True):
                stopper = wire.Stopper()
                events = client.stream("/stream", {}, stopper=stopper)
                assert await anext(events) == [b'{"choices":[{"text":"x"}]}']
                loop.call_later(0.2, stopper.stop)
                with pytest.raises(wire.Preempted):  # waiting for the next piece, read or pumped
                    await events.asend((lambda batch: True) if pumped else None)
                assert stopper.connection is None and not client._pool._busy and not client._pool._idle

            stopper = wire.Stopper()
            stopper.stop()
            sent = len(server.heads)
            with pytest.raises(wire.Preempted):
                await anext(client.stream("/stream", {}, stopper=stopper))
            assert len(server.heads) == sent  # stopped before it was sent: nothing sent

            ok = wire.Stopper()
            assert await client.post_json("/ok", {}) == {"ok": True}  # the pool serves on
            ok.stop()  # a stopper whose request is over touches nothing
            assert await client.post_json("/ok", {}) == {"ok": True}
            assert server.connections == 4  # the three stopped ones were not reused
            await client.close()

    run(test)
