"""Private PostgreSQL and Redis servers for tests: their own data folder and port, stopped at the end.

From Debian's `postgresql` and `redis-server` packages (.ci/run installs them). PostgreSQL refuses to
run as root: as root, its commands run as the `postgres` user, in a folder that user owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.support import die_with_parent, free_port


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} not found: install Debian's postgresql package (.ci/run does)")
    return found[-1]


class Postgres:
    def __init__(self, listen: str = "127.0.0.1", trust: str | None = None) -> None:
        self.listen = listen  # addresses, comma-separated; the first is the one in `url`
        self.trust = trust  # a network (CIDR) whose clients may connect too: the test hosts'
        self.root = Path(tempfile.mkdtemp(prefix="llmserver-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = ["runuser", "-u", "postgres", "--", *args] if self._as_postgres else list(args)
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def start(self) -> Postgres:
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        os.chmod(self.root, 0o755)
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '{self.listen}'\nunix_socket_directories = '{self.root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 300\n"
            )
        if self.trust is not None:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self.trust} trust\n")
        return self.resume()

    def resume(self) -> Postgres:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60", "start")
        return self

    def halt(self) -> None:
        """Stop the server at once (mode fast: clients are disconnected), keeping its data."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.halt()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.listen.split(',')[0]}:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database: its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        host = self.listen.split(",")[0]
        self._run(_pg_bin("psql"), "-h", host, "-p", str(self.port), "-U", "postgres", "-c", f"CREATE DATABASE {name}")
        return self.url(name)


class Redis:
    def __init__(self, bind: str = "127.0.0.1") -> None:
        self.bind = bind  # addresses, space-separated; the first is the one in `url`
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.root = Path(tempfile.mkdtemp(prefix="llmserver-redis-"))

    @property
    def url(self) -> str:
        return f"redis://{self.bind.split()[0]}:{self.port}/0"

    def start(self) -> Redis:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise RuntimeError("redis-server not found: install Debian's redis-server package (.ci/run does)")
        self.process = subprocess.Popen(
            # Protected mode would refuse the test hosts' addresses: this server is private to the tests.
            [binary, "--port", str(self.port), "--bind", *self.bind.split(), "--protected-mode", "no",
             "--save", "", "--appendonly", "no",
             "--dir", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                import socket

                with socket.create_connection((self.bind.split()[0], self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def flush(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        client.flushall()
        client.close()
