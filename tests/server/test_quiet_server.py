"""uvicorn's server as `llmserver serve` runs it (`http_protocol.QuietServer`): its main loop ticks
once a second instead of ten times, so a stop must wake it rather than wait for the tick, and the
Date header must still be there."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import aiohttp
import uvicorn
from starlette.responses import PlainTextResponse

from llmserver.server.http_protocol import QuietServer


def test_a_stop_signal_ends_it_at_once_and_answers_carry_a_date() -> None:
    async def test() -> tuple[str, float]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = QuietServer(uvicorn.Config(PlainTextResponse("ok"), lifespan="off", log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as answer:
            date = answer.headers["date"]
        await asyncio.sleep(0.3)  # mid-tick
        asked = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler takes it while serving
        await serving
        return date, time.monotonic() - asked

    # uvicorn puts back the handler it found and raises the signal again once stopped: let it be a no-op.
    previous = signal.signal(signal.SIGTERM, lambda number, frame: None)
    try:
        date, stopping = asyncio.run(test())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert date.endswith(" GMT")
    assert stopping < 0.5 * QuietServer.TICK  # woken by the stop, not by the next tick
