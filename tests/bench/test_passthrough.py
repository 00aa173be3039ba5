"""The benchmark's floor, `bench/passthrough.py`, on both of its clients: a real proxy process relays a
real upstream's JSON answer and its streamed chunks unchanged."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.support import aiohttp_server, free_port, write_events

ROOT = Path(__file__).resolve().parents[2]
PIECES = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]


async def upstream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response({"echo": body})
    response = await write_events(request, PIECES)
    await response.write_eof()
    return response


@pytest.mark.parametrize("client", ["aiohttp", "wire"])
def test_the_pass_through_relays_answers_unchanged(client: str) -> None:
    async def test() -> None:
        async with aiohttp_server("/v1/chat/completions", upstream) as up:
            port = free_port()
            proxy = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.passthrough", "--upstream", f"http://127.0.0.1:{up}",
                "--port", str(port), "--client", client, cwd=ROOT,
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                async with aiohttp.ClientSession() as session:
                    deadline = time.monotonic() + 20
                    while True:
                        try:
                            async with session.post(url, json={"n": 1}) as response:
                                assert await response.json() == {"echo": {"n": 1}}
                                break
                        except aiohttp.ClientConnectionError:
                            assert time.monotonic() < deadline and proxy.returncode is None
                            await asyncio.sleep(0.2)
                    async with session.post(url, json={"stream": True}) as response:
                        assert response.headers["content-type"].startswith("text/event-stream")
                        assert await response.read() == b"".join(PIECES)
            finally:
                proxy.terminate()
                await asyncio.wait_for(proxy.wait(), 10)

    asyncio.run(test())
