"""The floor: a bare pass-through proxy on the gateway's own stack (uvicorn, and aiohttp or llmserver's
own client towards llama-server), no auth, no accounting, no parsing. It forwards each request's body
to llama-server and relays each chunk of the answer unchanged. Whatever llmserver costs beyond this
is its own work.

    python -m bench.passthrough --upstream http://127.0.0.1:8081 --port 8090 [--client wire]

`aiohttp` (the default) is the floor the performance targets were set against; `wire` is the same
proxy on `llmserver.engine.wire`, the client llmserver itself uses: the floor lowered.
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn

from llmserver.engine import wire


class PassThrough:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                # At most 8 connections (llama-server serves parallel + 4 = 8 HTTP threads here and drops
                # connections beyond them), as llmserver keeps its own within them.
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=8), timeout=aiohttp.ClientTimeout(total=None)
                )
                await send({"type": "lifespan.startup.complete"})
            if self.session is not None:
                await self.session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        assert self.session is not None
        headers = {"content-type": "application/json"}
        url = self.upstream + scope["path"]
        for attempt in (1, 2, 3):  # llama-server may close a kept-alive connection just after a stream
            try:
                response = await self.session.request(scope["method"], url, data=body, headers=headers)
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if attempt == 3:
                    raise
        async with response:
            content_type = response.headers.get("content-type", "application/json").encode()
            start = {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(b"content-type", content_type)],
            }
            await send(start)
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class WirePassThrough:
    """The same proxy with llmserver's own HTTP/1.1 client towards llama-server."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.pool: wire.Pool | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                self.pool = wire.pool_for(self.upstream, limit=8)
                await send({"type": "lifespan.startup.complete"})
            if self.pool is not None:
                await self.pool.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        assert self.pool is not None
        for attempt in (1, 2, 3):  # as above: a kept-alive connection llama-server has just closed
            try:
                response = await self.pool.send(scope["method"], scope["path"], body or None, fresh=attempt > 1)
                break
            except wire.Unreachable:
                if attempt == 3:
                    raise
        try:
            headers = [(b"content-type", response.headers.get(b"content-type", b"application/json"))]
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            while chunk := await response.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self.pool.release(response)
        await send({"type": "http.response.body", "body": b""})


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
