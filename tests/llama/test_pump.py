"""The stream client's pump (`llama/client.py`): the events after the first go to a sink from the
connection's own callback. Against a real HTTP server on 127.0.0.1 that writes server-sent events in
HTTP/1.1 chunks, as llama-server does: an event split across writes, several in one write, a sink
that asks to stop (the rest is yielded as usual), and a connection that drops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from llmserver.errors import UpstreamError
from llmserver.llama.client import LlamaServerClient
from tests.support import aiohttp_server, write_events

Writes = list[bytes]

EVENTS = [f'{{"n":{n}}}'.encode() for n in range(6)]
WRITES: Writes = [
    b"data: " + EVENTS[0] + b"\n\n",
    b"data: " + EVENTS[1] + b"\n\ndata: " + EVENTS[2] + b"\n\n",  # two at once
    b"data: " + EVENTS[3][:3],  # one event in two writes
    EVENTS[3][3:] + b"\n\n",
    b"data: " + EVENTS[4] + b"\n\n",
    b"data: " + EVENTS[5] + b"\n\ndata: [DONE]\n\n",
]


@asynccontextmanager
async def serving(writes: Writes, *, drop: bool = False) -> AsyncIterator[tuple[LlamaServerClient, list[int]]]:
    """A server that answers each POST with `writes`, a moment apart; `drop`: it then cuts the
    connection instead of ending the body. Yields a client and the ports its requests came from."""
    peers: list[int] = []

    async def events(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        response = await write_events(request, writes)
        if drop:
            request.transport.close()  # type: ignore[union-attr]
            return response
        await response.write_eof()
        return response

    async with aiohttp_server("/stream", events) as port:
        client = LlamaServerClient(f"http://127.0.0.1:{port}")
        try:
            yield client, peers
        finally:
            await client.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def pumped_stream(client: LlamaServerClient) -> tuple[list[bytes], list[list[bytes]]]:
    """The first batch yielded, and the batches pumped after it."""
    pumped: list[list[bytes]] = []
    stream = client.stream("/stream", {})
    first = await anext(stream)
    with pytest.raises(StopAsyncIteration):
        await stream.asend(lambda batch: pumped.append(batch) or True)
    return first, pumped


def test_the_events_after_the_first_are_pumped_to_the_sink_in_order() -> None:
    async def test() -> None:
        async with serving(WRITES) as (client, peers):
            for _ in range(2):  # and again, after a pumped stream
                first, pumped = await pumped_stream(client)
                assert first == [EVENTS[0]]
                assert [data for batch in pumped for data in batch] == EVENTS[1:]
                assert [EVENTS[1], EVENTS[2]] in pumped  # written at once, taken at once
            assert len(peers) == 2

    run(test)


def test_a_sink_that_stops_gets_nothing_more_and_the_rest_is_yielded() -> None:
    async def test() -> None:
        async with serving(WRITES) as (client, _):
            pumped: list[bytes] = []

            def sink(batch: list[bytes]) -> bool:
                pumped.extend(batch)
                return False  # its client is slow

            stream = client.stream("/stream", {})
            received = list(await anext(stream))
            batch = await stream.asend(sink)
            received.extend(batch)
            async for batch in stream:
                received.extend(batch)
            # One batch pumped, then the rest yielded: each event once, in order.
            assert pumped == [EVENTS[1], EVENTS[2]]
            assert received[:1] + pumped + received[1:] == EVENTS

    run(test)


def test_a_connection_that_drops_while_pumped_raises() -> None:
    async def test() -> None:
        async with serving(WRITES[:4], drop=True) as (client, _):
            pumped: list[bytes] = []
            stream = client.stream("/stream", {})
            await anext(stream)
            with pytest.raises(UpstreamError, match="broken response"):  # as when not pumped
                await stream.asend(lambda batch: pumped.extend(batch) or True)
            assert pumped == EVENTS[1:4]  # all that came whole before the drop

    run(test)
