"""The floor: a bare pass-through proxy on the gateway's own stack (uvicorn, and aiohttp or llmserver's
own client towards llama-server), no auth, no accounting, no parsing. It forwards each request's body
to llama-server and relays each chunk of the answer unchanged. Whatever llmserver costs beyond this
is its own work.

    python -m bench.passthrough --upstream http://127.0.0.1:8081 --port 8090 [--client wire]

`aiohttp` (the default) is the floor the performance targets were set against; `wire` is the same
proxy on `llmserver.llama.wire`, the client llmserver itself uses: the floor lowered.
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn

from llmserver.llama import wire


class PassThrough:
    """The proxy on aiohttp's client: the floor the performance targets were set against."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await self.open()
                await send({"type": "lifespan.startup.complete"})
            await self.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        for attempt in (1, 2, 3):  # llama-server may close a kept-alive connection just after a stream
            try:
                await self.relay(scope["method"], scope["path"], body, send, fresh=attempt > 1)
                break
            except ConnectionDropped:
                if attempt == 3:
                    raise
        await send({"type": "http.response.body", "body": b""})

    async def open(self) -> None:
        # At most 8 connections (llama-server serves parallel + 4 = 8 HTTP threads here and drops
        # connections beyond them), as llmserver keeps its own within them.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=8), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def relay(self, method: str, path: str, body: bytes, send: Any, *, fresh: bool) -> None:
        """Forward the request and relay the answer's start and body chunks; ConnectionDropped when the
        connection dropped before any answer."""
        assert self.session is not None
        headers = {"content-type": "application/json"}
        try:
            response = await self.session.request(method, self.upstream + path, data=body, headers=headers)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise ConnectionDropped from exc
        async with response:
            await send(_start(response.status, response.headers.get("content-type", "application/json").encode()))
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})


class WirePassThrough(PassThrough):
    """The same proxy on llmserver's own HTTP/1.1 client towards llama-server (`llama/wire.py`)."""

    pool: wire.Pool | None = None

    async def open(self) -> None:
        self.pool = wire.pool_for(self.upstream, limit=8)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def relay(self, method: str, path: str, body: bytes, send: Any, *, fresh: bool) -> None:
        assert self.pool is not None
        try:
            response = await self.pool.send(method, path, body or None, fresh=fresh)
        except wire.Unreachable as exc:
            raise ConnectionDropped from exc
        try:
            await send(_start(response.status, response.headers.get(b"content-type", b"application/json")))
            while chunk := await response.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self.pool.release(response)


class ConnectionDropped(Exception):
    """llama-server dropped the connection before answering: the request may be sent again."""


def _start(status: int, content_type: bytes) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client", choices=("aiohttp", "wire"), default="aiohttp")
    args = parser.parse_args()
    app = WirePassThrough(args.upstream) if args.client == "wire" else PassThrough(args.upstream)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
