"""The agents' only way out: a proxy on 127.0.0.1 that relays plain requests to one llmserver and
refuses everything else (a `CONNECT` to any host, a request for an absolute URL off loopback),
recording each exchange so that a test can read what a client sent and what it was answered.

An agent is given this proxy both as its API's base URL and as `HTTP(S)_PROXY`: whatever it tries
to reach besides llmserver (its vendor's API, telemetry, updates) is refused here and listed in
`refused`, and never leaves the machine."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

HEAD_LIMIT = 1 << 16
KEPT = 1 << 22  # bytes of each body kept for the test to read


@dataclass
class Exchange:
    method: str
    path: str
    request: bytearray = field(default_factory=bytearray)  # its body
    status: int = 0
    response: bytearray = field(default_factory=bytearray)  # its head and body, as sent

    def json(self) -> Any:
        return json.loads(bytes(self.request)) if self.request else None

    def body(self) -> bytes:
        """The response's body (de-chunked when it was chunked)."""
        head, _, body = bytes(self.response).partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" not in head.lower():
            return body
        out, at = bytearray(), 0
        while at < len(body):
            end = body.find(b"\r\n", at)
            if end < 0:
                break
            size = int(body[at:end].split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out += body[end + 2 : end + 2 + size]
            at = end + 2 + size + 2
        return bytes(out)


class Gate:
    """Runs in a thread of its own until `stop`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.exchanges: list[Exchange] = []
        self.refused: list[str] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gate:
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def to(self, path: str) -> list[Exchange]:
        return [exchange for exchange in self.exchanges if exchange.path.split("?")[0] == path]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        server.close()  # and every exchange still open ends, its sockets closed, before the loop closes
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened = [writer]  # every connection of the exchange, closed however it ends
        try:
            await self._exchange(reader, writer, opened)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass
        finally:
            for connection in opened:
                connection.close()

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: list[asyncio.StreamWriter]
    ) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = [*lines[0].split(" "), "", ""][:3]
        local = target.startswith("/") or target.startswith(("http://127.0.0.1:", "http://localhost:"))
        if method == "CONNECT" or not local:
            self.refused.append(f"{method} {target}")
            writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            return
        path = target if target.startswith("/") else "/" + target.split("/", 3)[3]
        exchange = Exchange(method, path)
        self.exchanges.append(exchange)
        # One exchange a connection: upstream closes after its answer, and so does the gate.
        kept = [line for line in lines[1:] if line and not line.lower().startswith(("connection:", "keep-alive:"))]
        upstream_head = "\r\n".join([f"{method} {path} HTTP/1.1", *kept, "connection: close", "", ""])
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        opened.append(up_writer)
        up_writer.write(upstream_head.encode("latin-1"))
        # Whichever side ends first ends the exchange: a client that gives up closes llmserver's side too.
        to_upstream = asyncio.ensure_future(_pipe(reader, up_writer, exchange.request))
        to_client = asyncio.ensure_future(_pipe(up_reader, writer, exchange.response))
        try:
            await asyncio.wait([to_upstream, to_client], return_when=asyncio.FIRST_COMPLETED)
        finally:
            to_upstream.cancel()
            to_client.cancel()
            await asyncio.gather(to_upstream, to_client, return_exceptions=True)
        status = bytes(exchange.response[:12]).split(b" ")
        exchange.status = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kept: bytearray) -> None:
    try:
        while data := await reader.read(1 << 16):
            if len(kept) < KEPT:
                kept += data[: KEPT - len(kept)]
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
