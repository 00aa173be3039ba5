"""`llmserver serve --workers N`: N gateway processes serving one port.

One Python process serves a few hundred small requests a second on one core; `--workers` runs
several on the same address, each listening with SO_REUSEPORT so that the kernel spreads incoming
connections over them. Each worker is a gateway of its own (gateway_id-1 … -N): its own lease, its
own quota reservations and jobs, its load published to the others, exactly as gateways on separate
hosts — which is why workers need role `gateway` (the instances are the nodes') and PostgreSQL.

This process only supervises: it starts the workers, starts again one that dies (after 1 s, doubling
up to 30 s while they keep dying), and on SIGTERM or SIGINT passes a single SIGTERM to each, so that
they drain their requests as one gateway would. A worker that exits by itself within its first 10 s
(not killed by a signal) met a configuration or startup error: then every worker is stopped and the
command fails with its code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import click

from llmserver.commands import debugging
from llmserver.pool.instance import on_parent_death
from llmserver.settings import Settings
from llmserver.systemd import Notifier, worker_environ

log = logging.getLogger("llmserver.workers")

WORKER_ENV = "LLMSERVER_WORKER"  # set in each worker: its number, 1 … N (internal)
STARTUP = 10.0  # a worker that exits by itself sooner than this after its start failed to start


def bound_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A socket bound to the address, not yet listening: the server listens once its app has started,
    so that the kernel hands a starting worker no connection to keep waiting."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int, *, reuse_port: bool = False, purpose: str = "") -> socket.socket:
    """`bound_socket`, bound before any instance starts: a taken port is one line and exit 1 (with
    --debug, the traceback)."""
    import click

    try:
        return bound_socket(host, port, reuse_port=reuse_port)
    except OSError as exc:
        if debugging():
            raise
        raise click.ClickException(f"cannot listen on {host}:{port}{purpose}: {exc.strerror or exc}") from None


def worker_number() -> int | None:
    """This process's number when it is one of `--workers`' processes."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value else None


def supervise(settings: Settings) -> int:
    """Run `settings.server.workers` workers until told to stop; the command's exit code."""
    try:  # without SO_REUSEPORT: a port some other process holds is an error, not silently shared
        bound_socket(settings.server.host, settings.server.port, reuse_port=False).close()
    except OSError as exc:
        raise click.UsageError(
            f"cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror}"
        ) from None
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, stop)

    notifier = Notifier()
    relay = Relay() if notifier.active else None  # the workers' READY, for systemd's one READY

    def start(number: int) -> subprocess.Popen[bytes]:
        # Its own session: a Ctrl-C at the terminal reaches this process only, which passes it on once.
        relayed = worker_environ(relay.path) if relay is not None else {}
        return subprocess.Popen(
            [sys.executable, "-m", "llmserver", *sys.argv[1:]],
            env={**os.environ, WORKER_ENV: str(number), **relayed},
            start_new_session=True,
            # If the supervisor is killed outright, each worker gets SIGTERM and drains: no orphan keeps
            # the port. Safe here: the supervisor runs no threads.
            preexec_fn=on_parent_death(signal.SIGTERM),
        )

    workers = {number: start(number) for number in range(1, settings.server.workers + 1)}
    started = dict.fromkeys(workers, time.monotonic())
    delay = dict.fromkeys(workers, 1.0)
    server, gateway = settings.server, settings.state.gateway_id
    log.info(
        "%d gateway workers on http://%s:%s (gateways %s-1 … %s-%d)",
        server.workers, server.host, server.port, gateway, gateway, server.workers,
    )  # fmt: skip
    code = 0
    announced = False
    while not stopping:
        time.sleep(0.5)  # a dead worker is noticed within half a second
        if relay is not None and not announced:
            relay.read()
            if {p.pid for p in workers.values()} <= relay.ready:
                notifier.ready(f"{server.workers} gateway workers serving on {server.host}:{server.port}")
                announced = True
        if notifier.watchdog_seconds is not None:
            notifier.send("WATCHDOG=1")  # every half second: within any WatchdogSec of 1 s or more
        for number, process in list(workers.items()):
            if stopping or process.poll() is None:
                continue
            if process.returncode >= 0 and time.monotonic() - started[number] < STARTUP:
                log.error("worker %d exited with code %d while starting: stopping", number, process.returncode)
                code, stopping = process.returncode or 1, True
                break
            log.error(
                "worker %d (pid %d) exited with code %d: starting it again in %.0f s",
                number, process.pid, process.returncode, delay[number],
            )  # fmt: skip
            time.sleep(delay[number])
            delay[number] = min(30.0, delay[number] * 2)
            workers[number], started[number] = start(number), time.monotonic()
    notifier.stopping()
    for process in workers.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + settings.server.drain_timeout + 15
    for process in workers.values():
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if relay is not None:
        relay.close()
    return code


class Relay:
    """A datagram socket the workers notify instead of systemd: which of them said READY=1 (by MAINPID)."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="llmserver-notify-")
        self.path = os.path.join(self._folder, "notify.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._socket.bind(self.path)
        self._socket.setblocking(False)
        self.ready: set[int] = set()

    def read(self) -> None:
        while True:
            try:
                message = self._socket.recv(4096).decode(errors="replace").split("\n")
            except BlockingIOError:
                return
            fields = dict(line.partition("=")[::2] for line in message)
            if fields.get("READY") == "1" and fields.get("MAINPID", "").isdigit():
                self.ready.add(int(fields["MAINPID"]))

    def close(self) -> None:
        self._socket.close()
        shutil.rmtree(self._folder, ignore_errors=True)
