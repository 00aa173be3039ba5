"""systemd's notify protocol (sd_notify(3)), for units of `Type=notify`: one datagram per state on the
unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace).

`llmserver serve` says `READY=1` once its port listens and its app has started (for a gateway of
role `gateway`: the first read of the instance registry done), `llmserver node` once its instances
are started and published; both say `STOPPING=1` when told to stop. With `WatchdogSec=` in the unit
(`$WATCHDOG_USEC`), a task on the process's event loop sends `WATCHDOG=1` every half period: a loop
that hangs stops the pings, and systemd restarts the service. `serve --workers N` relays: each worker
notifies the supervising process, which says `READY=1` once every worker is ready and pings the
watchdog while it supervises. Outside systemd (no `$NOTIFY_SOCKET`) every call does nothing.

The protocol is a few lines; a library for it (sdnotify, systemd-python) would be a dependency for a
single `sendto`, the second one a C extension built against libsystemd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + address[1:] if address.startswith("@") else address) or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_seconds: float | None = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """One notification (`READY=1`, `STATUS=…`); False when there is no socket or it failed."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.warning("systemd notification %s not sent: %s", fields[0] if fields else "", exc)
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str = "stopping: draining requests") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self) -> None:
        """Ping the watchdog from the running event loop, every half period (if the unit asks for one)."""
        if self.watchdog_seconds is not None and self.active and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ping(), name="systemd-watchdog")

    async def stop_watchdog(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _ping(self) -> None:
        assert self.watchdog_seconds is not None
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_seconds / 2)


def worker_environ(relay: str) -> dict[str, str]:
    """What a worker of `serve --workers` gets instead of systemd's socket: the supervisor's relay, and no
    watchdog of its own (the supervisor pings it)."""
    return {"NOTIFY_SOCKET": relay, "WATCHDOG_USEC": "", "WATCHDOG_PID": ""}
