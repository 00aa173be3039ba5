"""Running the real server for tests: a `llmserver serve` process on free ports in a temp data dir."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct-Q4_1"
# An untemplated counting prompt that the embedded model continues to max_tokens. Greedy chat answers
# are not as long everywhere: "Count from 1 to 1000" stops after 122 tokens on some CPUs.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_range(size: int) -> int:
    """The first of `size` consecutive free ports (for instances, which take base, base+1, …)."""
    for _ in range(200):
        base = free_port()
        if base + size > 65000:
            continue
        ok = True
        for port in range(base, base + size):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def cli(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserver", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def create_key(data_dir: Path, name: str, admin: bool = False) -> str:
    result = cli(data_dir, "keys", "create", "--name", name, *(["--admin"] if admin else []))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@dataclass
class Server:
    data_dir: Path
    config: str = ""
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    instance_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def instance_url(self) -> str:
        return f"http://127.0.0.1:{self.instance_port}"

    def start(self, timeout: float = 180.0) -> Server:
        self.port = free_port()
        self.instance_port = free_port_range(4)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "llmserver", "serve", "--data-dir", str(self.data_dir), "--port", str(self.port)]
        if self.config:
            config_path = self.data_dir / "config.toml"
            config_path.write_text(self.config)
            args += ["--config", str(config_path)]
        env = {**os.environ, "LLMSERVER_INSTANCE_BASE_PORT": str(self.instance_port), **self.env}
        self.log_path = self.data_dir / "gateway.log"
        with self.log_path.open("ab") as log:
            # If pytest itself dies, its servers (and so their instances) die with it.
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log()}")

    def generate_ok(self) -> bool:
        """One tiny native request with a fresh key: does the server serve?"""
        key = create_key(self.data_dir, "probe")
        response = httpx.post(
            self.url + "/api/generate",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        return response.status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def busy_slots(server: Server) -> int:
    """Slots of the server's first instance that are generating now (llama-server's own /slots)."""
    return sum(slot["is_processing"] for slot in httpx.get(server.instance_url + "/slots").json())


def pids_of_children_named(name: str, parent: int) -> list[int]:
    """PIDs of live processes named `name` whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if comm == name[:15] and int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def process_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def make_key(data_dir: Path, name: str, admin: bool = False, **limits: object) -> str:
    """A key written straight into the server's database (what `keys create` does, without a process)."""
    import asyncio

    from llmserver.auth.keys import KeyService
    from llmserver.store import KeyLimits
    from llmserver.store.sqlite import SQLiteStore

    async def create() -> str:
        store = SQLiteStore(data_dir / "llmserver.db")
        try:
            return (await KeyService(store).create(name, admin=admin, limits=KeyLimits(**limits)))[1]  # type: ignore[arg-type]
        finally:
            await store.close()

    return asyncio.run(create())


def make_key_record(data_dir: Path, name: str, **limits: object) -> tuple[str, str]:
    """A key written into the server's database: (its id, the key)."""
    import asyncio

    from llmserver.auth.keys import KeyService
    from llmserver.store import KeyLimits
    from llmserver.store.sqlite import SQLiteStore

    async def create() -> tuple[str, str]:
        store = SQLiteStore(data_dir / "llmserver.db")
        try:
            record, key = await KeyService(store).create(name, limits=KeyLimits(**limits))  # type: ignore[arg-type]
            return record.id, key
        finally:
            await store.close()

    return asyncio.run(create())


def use_total_quota(data_dir: Path, key_id: str, tokens: int) -> None:
    """Charge `tokens` to a key's total quota, as finished requests would have."""
    import asyncio

    from llmserver.store import Settlement, UsageBatch
    from llmserver.store.sqlite import SQLiteStore

    async def charge() -> None:
        store = SQLiteStore(data_dir / "llmserver.db")
        try:
            await store.record(UsageBatch(settlements=[Settlement(key_id, "total", "tests", 0, tokens)]))
        finally:
            await store.close()

    asyncio.run(charge())


def metric(server: Server, admin_key: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when it has none yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {admin_key}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
