"""systemd's notify protocol against a real datagram socket, as systemd listens on one: the notifier
itself, then `llmserver serve`, `llmserver node` and `serve --workers 2` started with `$NOTIFY_SOCKET`
(READY only once they serve, WATCHDOG pings at half the period, STOPPING at a stop); and the unit files
under deploy/systemd pass `systemd-analyze verify`."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from llmserver.systemd import Notifier
from tests.support import MODEL, Server, free_port, free_port_range, shared_servers, spawn, wait_for

ROOT = Path(__file__).resolve().parent.parent


class Listener:
    """A datagram socket where systemd would listen: every notification received, as a dict."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(path)
        self.socket.settimeout(0.1)
        self.received: list[tuple[float, dict[str, str]]] = []

    def drain(self) -> list[dict[str, str]]:
        while True:
            try:
                data = self.socket.recv(4096)
            except TimeoutError:
                return [fields for _, fields in self.received]
            fields = dict(line.partition("=")[::2] for line in data.decode().split("\n"))
            self.received.append((time.monotonic(), fields))

    def first(self, key: str) -> dict[str, str] | None:
        return next((fields for fields in self.drain() if key in fields), None)

    def count(self, key: str) -> int:
        return sum(1 for fields in self.drain() if key in fields)


@contextmanager
def listening(tmp_path: Path) -> Iterator[Listener]:
    listener = Listener(str(tmp_path / "notify.sock"))
    try:
        yield listener
    finally:
        listener.socket.close()


def test_the_notifier_speaks_the_protocol(tmp_path: Path) -> None:
    assert Notifier({}).send("READY=1") is False  # outside systemd: nothing
    with listening(tmp_path) as listener:
        notifier = Notifier({"NOTIFY_SOCKET": listener.path})
        notifier.ready("serving")
        notifier.stopping()
        assert listener.drain() == [
            {"READY": "1", "STATUS": "serving", "MAINPID": str(os.getpid())},
            {"STOPPING": "1", "STATUS": "stopping: draining requests"},
        ]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # `@name`: the abstract namespace
    abstract.bind(f"\0llmserver-test-{os.getpid()}")
    abstract.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": f"@llmserver-test-{os.getpid()}"}).send("READY=1")
        assert abstract.recv(100) == b"READY=1"
    finally:
        abstract.close()


def test_the_watchdog_pings_at_half_the_period_and_only_for_its_own_pid(tmp_path: Path) -> None:
    with listening(tmp_path) as listener:
        others = Notifier({"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
        assert others.watchdog_seconds is None  # the watchdog is another process's

        async def run() -> None:
            notifier = Notifier({"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "200000"})
            notifier.start_watchdog()
            await asyncio.sleep(0.55)
            await notifier.stop_watchdog()

        asyncio.run(run())
        assert listener.count("WATCHDOG") in (5, 6, 7)  # at 0, 0.1, 0.2 … 0.5 s: half of 0.2 s apart


def test_serve_says_ready_once_it_serves_pings_and_says_stopping(tmp_path: Path) -> None:
    with listening(tmp_path) as listener:
        config = f'[[models]]\nname = "{MODEL}"\nparallel = 1\nctx_size = 512\nthreads = 1\n'
        env = {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "1000000"}
        server = Server(data_dir=tmp_path / "data", config=config, env=env)
        server.start()
        try:
            ready = listener.first("READY")
            assert ready is not None and ready["MAINPID"] == str(server.process.pid)  # type: ignore[union-attr]
            assert ready["STATUS"] == f"serving on 127.0.0.1:{server.port}"
            assert wait_for(lambda: listener.count("WATCHDOG") >= 3, 5)  # every 0.5 s
            assert listener.count("READY") == 1
        finally:
            assert server.stop() == 0
        assert listener.first("STOPPING") is not None


def test_serve_is_not_ready_before_its_port_answers(tmp_path: Path) -> None:
    """READY comes after the app started: by then /health answers (systemd orders dependents on it)."""
    with listening(tmp_path) as listener:
        port = free_port()
        data = tmp_path / "data"
        process = spawn(
            [sys.executable, "-m", "llmserver", "serve", "--port", str(port), "--data-dir", str(data)],
            tmp_path / "serve.log",
            {**os.environ, "NOTIFY_SOCKET": listener.path, "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4))},
        )
        try:
            assert wait_for(lambda: listener.first("READY") is not None, 120), (tmp_path / "serve.log").read_text()
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0


def test_a_node_says_ready_once_its_instances_are_published(tmp_path: Path) -> None:
    _, shared = shared_servers()
    url = shared.url.rsplit("/", 1)[0] + "/10"
    client = redis.Redis.from_url(url)
    client.flushdb()
    with listening(tmp_path) as listener:
        config = tmp_path / "node.toml"
        config.write_text(f'[[models]]\nname = "{MODEL}"\nparallel = 1\nctx_size = 512\nthreads = 1\n')
        env = {**os.environ, "NOTIFY_SOCKET": listener.path, "LLMSERVER_NODE__ID": "notifying",
               "LLMSERVER_NODE__PORT": "0", "LLMSERVER_INSTANCES__API_KEY": "systemd-test-instance-key",
               "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4))}  # fmt: skip
        node = spawn([sys.executable, "-m", "llmserver", "node", "--config", str(config), "--data-dir",
                      str(tmp_path / "node"), "--redis-url", url], tmp_path / "node.log", env)  # fmt: skip
        try:
            assert wait_for(lambda: listener.first("READY") is not None, 120), (tmp_path / "node.log").read_text()
            published = [key for key in client.scan_iter("llmserver:instance:*")]
            assert len(published) == 1  # published before it said so
        finally:
            node.send_signal(signal.SIGTERM)
            assert node.wait(60) == 0
            client.close()
        assert listener.first("STOPPING") is not None


def test_workers_are_ready_together(tmp_path: Path) -> None:
    """`serve --workers 2`: one READY, from the supervising process, once both workers serve."""
    postgres, shared = shared_servers()
    database_url = postgres.new_database()
    migrated = subprocess.run([sys.executable, "-m", "llmserver", "db", "migrate", "--database-url", database_url],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    with listening(tmp_path) as listener:
        port = free_port()
        env = {**os.environ, "NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "2000000", "LLMSERVER_ROLE": "gateway",
               "LLMSERVER_STATE__DATABASE_URL": database_url, "LLMSERVER_STATE__REDIS_URL": shared.url.rsplit("/",
               1)[0] + "/11",
               "LLMSERVER_SERVER__WORKERS": "2", "LLMSERVER_STATE__GATEWAY_ID": "notify-workers"}  # fmt: skip
        process = spawn([sys.executable, "-m", "llmserver", "serve", "--port", str(port), "--data-dir",
                         str(tmp_path / "gw")], tmp_path / "serve.log", env)  # fmt: skip
        try:
            assert wait_for(lambda: listener.first("READY") is not None, 120), (tmp_path / "serve.log").read_text()
            ready = listener.first("READY")
            assert ready is not None and "2 gateway workers" in ready["STATUS"]
            assert ready["MAINPID"] == str(process.pid)
            workers = {httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code for _ in range(4)}
            assert workers == {200}
            assert wait_for(lambda: listener.count("WATCHDOG") >= 2, 5)
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0
        assert listener.count("READY") == 1 and listener.first("STOPPING") is not None


@pytest.mark.parametrize("unit", sorted((ROOT / "deploy" / "systemd").glob("*.service")), ids=lambda p: p.name)
def test_the_unit_files_pass_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: scripts/setup.sh --test installs Debian's systemd package")
    # Its ExecStart names /opt/llmserver/.venv/bin/llmserver: verify wants the executable to exist.
    root = tmp_path / "root"
    copy = root / unit.name
    root.mkdir()
    text = unit.read_text().replace(
        "/opt/llmserver/.venv/bin/llmserver", str(Path(sys.executable).parent / "llmserver")
    )
    copy.write_text(text)
    verified = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    problems = [line for line in verified.stderr.splitlines() if unit.name in line]
    assert problems == [], problems
