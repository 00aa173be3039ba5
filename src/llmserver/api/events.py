"""The response for a server-sent-event stream, lean per token.

Starlette's StreamingResponse runs each stream in an anyio task group beside a second task that
listens for the disconnect, and every chunk passes through each middleware's `send` wrapper. This
response sends its start (and its end) through the middleware stack, where the access log and the
quota headers see them (`middleware.Front`), and the body's chunks past it: the first through the
server's own `send`, which `Front` leaves in the scope, and the rest, where the server is llmserver's
own (`http_protocol`), through a `DirectWriter` the body is sent (`asend`): the relay
(`engine/generation.py`) then shapes and writes each batch of tokens in the callback of the
connection it came in on, no task woken for it.
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

from llmserver.engine.generation import Writer
from llmserver.http_protocol import Cycle

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
        writer = DirectWriter.of(direct)
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


class DirectWriter:
    """Writes body chunks of a started response straight to the connection's transport, framed as its
    `send` frames them (HTTP/1.1 chunked), for a body that pumps its chunks from a callback (the relay,
    `engine/generation.py`). It says False once the client is gone (and writes nothing) or its
    connection's buffer is full (flow control; what it was given is written all the same): the body
    then goes back to being sent, and awaited, through `send`."""

    __slots__ = ("_cycle", "_write")

    def __init__(self, cycle: Cycle) -> None:
        self._cycle = cycle
        self._write = cycle.transport.write

    @classmethod
    def of(cls, send: Send) -> DirectWriter | None:
        """For llmserver's server's own `send` of a chunked response (an SSE stream is one); None for
        any other (another server's, a test transport's)."""
        cycle = getattr(send, "__self__", None)
        if type(cycle) is not Cycle or cycle.chunked is not True or cycle.complete:
            return None
        return cls(cycle)

    def __call__(self, body: bytes) -> bool:
        cycle = self._cycle
        if cycle.disconnected:
            return False  # nobody to read it (the watcher is cancelling the stream)
        self._write(b"%x\r\n%b\r\n" % (len(body), body))  # written even when paused: nothing is dropped
        return not cycle.protocol.write_paused
