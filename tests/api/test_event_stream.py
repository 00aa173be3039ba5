"""The SSE response (`api/events.py`) under llmserver's own server on 127.0.0.1 (uvicorn's, with
`http_protocol.GatewayProtocol`): its body is sent the writer the server's `DIRECT_WRITE` extension
(`asgi_ext`) opens after the first chunk, and what the
body writes through it reaches the client framed and in order with what it yields. Under any other
server (plain uvicorn, httpx's ASGI transport) it is sent nothing and works as a plain stream."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator

import aiohttp
import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from llmserver.api.events import EventStream
from llmserver.asgi_ext import Writer
from llmserver.server.http_protocol import DirectWriter, GatewayProtocol


def app_and_seen() -> tuple[object, list[Writer | None]]:
    seen: list[Writer | None] = []

    async def body() -> AsyncGenerator[bytes, Writer | None]:
        writer = yield b"data: 1\n\n"
        seen.append(writer)
        if writer is not None:
            assert writer(b"data: 2\n\n")
            assert writer(b"data: 3\n\n")
        else:
            yield b"data: 2\n\ndata: 3\n\n"
        yield b"data: [DONE]\n\n"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        await EventStream(body(), {})(scope, receive, send)

    return app, seen


def served(app: object, http: type[asyncio.Protocol] | str) -> bytes:
    """What a GET of `app` under uvicorn's server with the protocol `http` answers."""

    async def test() -> bytes:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_level="warning"))  # type: ignore[arg-type]
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
            await asyncio.sleep(0.01)
        try:
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as answer:
                assert answer.headers["content-type"].startswith("text/event-stream")
                return await answer.read()
        finally:
            server.should_exit = True
            await serving

    return asyncio.run(test())


def test_under_llmservers_server_the_body_writes_directly() -> None:
    app, seen = app_and_seen()
    assert served(app, GatewayProtocol) == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    assert len(seen) == 1 and isinstance(seen[0], DirectWriter)


def test_elsewhere_it_is_a_plain_stream() -> None:
    app, seen = app_and_seen()

    async def test() -> bytes:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/")).content

    assert asyncio.run(test()) == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    assert served(app, "httptools") == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"  # uvicorn's own
    assert seen == [None, None]


class Cycle:
    """Stand-in for the server's cycle in the two states a real client is slow to produce on demand:
    its connection's buffer full (flow control paused), and the client gone."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.transport = type("Transport", (), {"write": self.written.append})()
        self.protocol = type("Protocol", (), {"write_paused": False})()
        self.disconnected = False
        self.complete = False


def test_a_paused_client_still_gets_what_was_given_and_a_gone_one_nothing() -> None:
    cycle = Cycle()
    writer = DirectWriter(cycle)  # type: ignore[arg-type]
    assert writer(b"data: 1\n\n") is True
    cycle.protocol.write_paused = True
    assert writer(b"data: 2\n\n") is False  # stop pumping, but this chunk is not lost
    cycle.disconnected = True
    assert writer(b"data: 3\n\n") is False
    assert cycle.written == [b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n"]
