"""The response for a server-sent-event stream, lean per token.

Starlette's StreamingResponse runs each stream in an anyio task group beside a second task that
listens for the disconnect, and every chunk passes through each middleware's `send` wrapper (five
coroutine frames a token here). This response sends its start (and its end) through the middleware
stack, where the access log, the quota headers and the error middleware see them, and each chunk of
the body straight to the server's own `send` (`DirectBody` puts it in the scope): every middleware
here acts on the start message only. One watcher task per stream waits for the client to leave and
then cancels the stream's task: the body generator is closed at once, which closes the connection
to llama-server (it stops generating) and the request's ticket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

RAW_SEND = "llmserver.send"


class DirectBody:
    """The outermost middleware: it leaves the server's `send` in the scope for `EventStream`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class EventStream(Response):
    """A 200 `text/event-stream` of the chunks `body` yields (a Response, so that FastAPI passes it on)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[bytes], headers: Mapping[str, str]) -> None:
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
        try:
            async for chunk in self.body_iterator:
                await direct({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True  # the end makes the server's receive() say http.disconnect: not a departure
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: nobody to answer, and nothing went wrong here
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()
        if self.background is not None:
            await self.background()
