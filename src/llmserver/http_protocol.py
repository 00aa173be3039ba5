"""uvicorn, adjusted: its HTTP protocol with a read timeout, and its server waking once a second.

A connection whose request stops arriving (headers without their blank line, a body shorter than
its Content-Length) is closed once nothing has come for `read_timeout` seconds, instead of being
held open forever (uvicorn only times out idle keep-alive connections between requests). The cost
on the hot path is one clock read per chunk received while a request is being read; a timer runs
only while a request is incomplete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class ReadTimeoutProtocol(HttpToolsProtocol):
    read_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading = True  # a connection starts by waiting for its first request
        self._last_read = self.loop.time()
        self._read_timer: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout, self._check_read)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if not self._reading:
            self._reading = True
            self._arm()
        super().data_received(data)

    def on_message_complete(self) -> None:
        self._reading = False
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._check_read)

    def _check_read(self) -> None:
        self._read_timer = None
        if not self._reading or self.transport.is_closing():
            return
        waited = self.loop.time() - self._last_read
        if waited < self.read_timeout:
            self._read_timer = self.loop.call_later(self.read_timeout - waited, self._check_read)
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info("closing the connection from %s: its request stopped arriving %.0f s ago", client, waited)
        self.transport.close()


def with_read_timeout(seconds: float) -> type[ReadTimeoutProtocol]:
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": seconds})


class QuietServer(uvicorn.Server):
    """uvicorn's server, whose main loop wakes ten times a second to refresh the Date header (once a
    second) and to see whether a stop was asked for: here it wakes once a second, and a stop signal
    wakes it at once. Each wake-up of an idle process costs it 0.1 to 0.2 ms of CPU on this kind of VM."""

    TICK = 1.0  # seconds

    async def main_loop(self) -> None:
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while not await self.on_tick(0):  # a multiple of 10: every tick refreshes the Date header
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.TICK):
                    await self._stopping.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if hasattr(self, "_loop"):  # the signal handler runs between bytecodes: wake the loop safely
            self._loop.call_soon_threadsafe(self._stopping.set)
