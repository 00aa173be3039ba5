"""The one retry policy, against a stand-in for llama-server on 127.0.0.1 that drops connections
before answering on demand (a fault the real one shows only by chance: a kept-alive connection it
closes just as the next request is written)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from llmserver.auth.keys import Principal
from llmserver.engine.calls import InstanceCalls
from llmserver.errors import ContextLengthExceeded, InstanceUnavailable
from llmserver.pool.admission import Admission, Ticket
from llmserver.pool.instance import Instance
from tests.support.pool import World, world


class StandIn:
    """Answers each request by the next step of its script: "drop" closes the connection unanswered,
    "json" answers a completion, "sse" streams two events, "400" refuses the prompt."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.requests = 0
        self.port = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                step = self.script[min(self.requests, len(self.script) - 1)]
                self.requests += 1
                if step == "drop":
                    break
                writer.write(_answer(step))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _answer(step: str) -> bytes:
    if step == "sse":
        events = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        kind, status = b"text/event-stream", b"200 OK"
    elif step == "400":
        error = {
            "error": {"type": "exceed_context_size_error", "message": "too long", "n_prompt_tokens": 9, "n_ctx": 8}
        }
        body, kind, status = json.dumps(error).encode(), b"application/json", b"400 Bad Request"
    else:
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        body = json.dumps({"choices": [{"text": "hi", "finish_reason": "stop"}], "usage": usage}).encode()
        kind, status = b"application/json", b"200 OK"
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\n\r\n" + body
    )  # fmt: skip


@asynccontextmanager
async def stand_in(tmp_path: Path, script: list[str]) -> AsyncIterator[tuple[World, StandIn, list[Instance]]]:
    fake = StandIn(script)
    server = await fake.start()
    async with world(tmp_path, max_queue=4) as w:
        pool = w.supervisor.pools["m"]
        (instance,) = pool.instances
        assert instance.client is not None
        await instance.client.close()
        instance.port = fake.port
        instance.client = type(instance.client)(instance.base_url)
        reported: list[Instance] = []
        pool._on_failure = reported.append
        yield w, fake, reported
    server.close()
    await server.wait_closed()


async def admitted(admission: Admission) -> Ticket:
    ticket = await admission.admit(Principal("key_k", "k", "ffffffff", False), "/x", "m", 10)
    await admission.take_slot(ticket)
    return ticket


def run(
    tmp_path: Path,
    script: list[str],
    test: Callable[[InstanceCalls, Ticket, StandIn, list[Instance]], Awaitable[None]],
    attempts: int = 2,
) -> None:
    async def scenario() -> None:
        async with stand_in(tmp_path, script) as (w, fake, reported):
            calls = InstanceCalls(w.admission, attempts=attempts, timeout=10)
            ticket = await admitted(w.admission)
            try:
                await test(calls, ticket, fake, reported)
            finally:
                ticket.close("ok")

    asyncio.run(scenario())


def test_a_dropped_connection_is_sent_again_once(tmp_path: Path) -> None:
    async def test(calls: InstanceCalls, ticket: Ticket, fake: StandIn, reported: list[Instance]) -> None:
        body = await calls.call(ticket, "/v1/completions", {"prompt": "x"})
        assert body["choices"][0]["text"] == "hi"
        assert fake.requests == 2 and len(reported) == 1  # the failed instance was reported to its pool
        assert ticket.lease.instance is not None  # a fresh slot was taken for the second send

    run(tmp_path, ["drop", "json"], test)


def test_a_request_is_sent_at_most_attempts_times(tmp_path: Path) -> None:
    async def test(calls: InstanceCalls, ticket: Ticket, fake: StandIn, reported: list[Instance]) -> None:
        with pytest.raises(InstanceUnavailable):
            await calls.call(ticket, "/v1/completions", {"prompt": "x"})
        assert fake.requests == 2 and len(reported) == 2

    run(tmp_path, ["drop"], test)

    async def once(calls: InstanceCalls, ticket: Ticket, fake: StandIn, reported: list[Instance]) -> None:
        with pytest.raises(InstanceUnavailable):
            await calls.call(ticket, "/v1/completions", {"prompt": "x"})
        assert fake.requests == 1

    run(tmp_path, ["drop"], once, attempts=1)


def test_an_answer_that_is_an_error_is_never_sent_again(tmp_path: Path) -> None:
    async def test(calls: InstanceCalls, ticket: Ticket, fake: StandIn, reported: list[Instance]) -> None:
        with pytest.raises(ContextLengthExceeded):
            await calls.call(ticket, "/v1/completions", {"prompt": "x"})
        assert fake.requests == 1 and not reported

    run(tmp_path, ["400", "json"], test)


def test_a_stream_is_sent_again_only_before_its_first_event(tmp_path: Path) -> None:
    async def test(calls: InstanceCalls, ticket: Ticket, fake: StandIn, reported: list[Instance]) -> None:
        first, events = await calls.open_stream(ticket, "/v1/completions", {"prompt": "x", "stream": True})
        rest = [data async for batch in events for data in batch]
        assert [orjson.loads(data) for data in [*first, *rest]] == [
            {"choices": [{"delta": {"content": c}}]} for c in "ab"
        ]
        assert fake.requests == 2

    run(tmp_path, ["drop", "sse"], test)
