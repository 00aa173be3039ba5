"""uvicorn's HTTP protocol with a read timeout: a connection whose request stops arriving (headers
without their blank line, a body shorter than its Content-Length) is closed once nothing has come
for `read_timeout` seconds, instead of being held open forever (uvicorn only times out idle
keep-alive connections between requests).

The cost on the hot path is one clock read per chunk received while a request is being read; a
timer runs only while a request is incomplete.
"""

from __future__ import annotations

import asyncio
import logging

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
