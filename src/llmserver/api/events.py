"""The response for a server-sent-event stream, lean per token.

Starlette's StreamingResponse runs each stream in an anyio task group beside a second task that
listens for the disconnect, and every chunk passes through each middleware's `send` wrapper. This
response sends its start (and its end) through the middleware stack, where the access log and the
quota headers see them (`server/front.Front`), and the body's chunks past it: the first through the
server's own `send`, which `Front` leaves in the scope, and the rest, where the server offers the
`DIRECT_WRITE` extension (`asgi_ext`; llmserver's own server does), through the writer it opens, which
the body is sent (`asend`): the relay (`engine/generation.py`) then shapes and writes each batch of
tokens in the callback of the connection it came in on, no task woken for it.
One watcher task per stream waits for the client to leave and then cancels the stream's task: the
body generator is closed at once, which closes the connection to llama-server (it stops generating)
and the request's ticket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llmserver.asgi_ext import DIRECT_WRITE, OpenWriter, Writer

RAW_SEND = "llmserver.send"  # the scope key of the server's own `send`


class EventStream(Response):
    """A 200 `text/event-stream` of the chunks `body` yields (a Response, so that FastAPI passes it on)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[bytes, Writer | None], headers: Mapping[str, str]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self.raw_headers += [(name.lower().encode(), value.encode()) for name, value in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        finished = gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                gone = True
                task.cancel()

        direct: Send = scope.get(RAW_SEND, send)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        watcher = asyncio.get_running_loop().create_task(watch())
        body = self.body_iterator
        opener: OpenWriter | None = scope.get("extensions", {}).get(DIRECT_WRITE)
        writer: Writer | None = opener(direct) if opener is not None else None
        try:
            chunk = await anext(body, None)
            while chunk is not None:
                await direct({"type": "http.response.body", "body": chunk, "more_body": True})
                try:
                    chunk = await body.asend(writer)
                except StopAsyncIteration:
                    chunk = None
            finished = True  # the end makes the server's receive() say http.disconnect: not a departure
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: nobody to answer, and nothing went wrong here
        finally:
            watcher.cancel()
            await body.aclose()
        if self.background is not None:
            await self.background()
