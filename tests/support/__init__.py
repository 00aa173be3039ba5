"""Running the real server for tests: a `llmserver serve` process on free ports in a temp data dir.

`LLMSERVER_TEST_DATABASE=postgresql` runs every server of the suite on PostgreSQL and Redis instead of
SQLite: private servers started on first use, a fresh migrated database per data dir (the CLI helpers
and `make_key` use the same one), so that the whole suite runs on either engine.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import hashlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from llmserver.store import Store, open_store

if TYPE_CHECKING:
    from aiohttp import web

    from tests.support.services import Postgres, Redis

# Under pytest-xdist (`-n 2`, the default: pyproject.toml) each worker keeps to a CPU of its own, and so
# does every server it starts (affinity is inherited; llmserver shares out the CPUs it may run on).
# llama.cpp's threads spin while they wait: two workers' instances on the same cores slow each other down
# many times over, and deadlines a test sets would then be missed for no fault of the server.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cpus, _workers = sorted(os.sched_getaffinity(0)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _share = max(1, len(_cpus) // _workers)
    _first = int(_WORKER[2:]) * _share % len(_cpus)
    os.sched_setaffinity(0, set(_cpus[_first : _first + _share]))
# Each worker also has a TMPDIR of its own, which every server it starts inherits: what a server makes there
# (the document converters' private folder, say) is never taken for another worker's.
if _WORKER.startswith("gw"):
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"llmserver-tests-{_WORKER}-", dir=tempfile.gettempdir())
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    os.chmod(os.environ["TMPDIR"], 0o1777)  # as /tmp: the private PostgreSQL runs as another user
    atexit.register(shutil.rmtree, os.environ["TMPDIR"], True)
# The threads a test instance that wants all of this test process's CPUs (up to 2) is given.
THREADS = min(2, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 2

MODEL = "SmolLM2-135M-Instruct-Q4_1"
# An untemplated counting prompt that the embedded model continues to max_tokens. Greedy chat answers
# are not as long everywhere: "Count from 1 to 1000" stops after 122 tokens on some CPUs.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


# Under pytest-xdist each worker takes its ports from a range of its own, below the kernel's ephemeral
# ports. A port picked free is bound only later, by the server started on it, and llama-server listens with
# SO_REUSEPORT: two workers that picked the same port would each start an instance there, and the kernel
# would share either's connections between the two (a request answered by the other test's instance).
PORTS = (10000, 32000)
if _WORKER.startswith("gw"):
    _span = (PORTS[1] - PORTS[0]) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    PORTS = (PORTS[0] + int(_WORKER[2:]) * _span, PORTS[0] + (int(_WORKER[2:]) + 1) * _span)


def free_port(size: int = 1) -> int:
    """A port nothing listens on now (the first of `size` in this worker's range when under xdist)."""
    if not _WORKER.startswith("gw"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(1000):
        port = random.randrange(PORTS[0], PORTS[1] - size)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS[0]}-{PORTS[1]}")


@asynccontextmanager
async def aiohttp_server(path: str, handler: Any) -> AsyncIterator[int]:
    """An aiohttp server on 127.0.0.1 answering POST `path` with `handler`: its port."""
    from aiohttp import web  # only the tests that serve import it

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def write_events(request: web.Request, pieces: list[bytes]) -> web.StreamResponse:
    """A chunked `text/event-stream` answer to an aiohttp `request`, its `pieces` written a moment
    apart; the caller ends it (`write_eof`) or cuts the connection."""
    from aiohttp import web  # only the tests that serve import it

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
        await asyncio.sleep(0.01)
    return response


def free_port_range(size: int, avoid: int | None = None) -> int:
    """The first of `size` consecutive free ports (for instances, which take base, base+1, …), none of
    them `avoid` (a port already picked but not yet bound: the kernel may offer it again)."""
    for _ in range(200):
        base = free_port(size)
        if base + size > 65000 or (avoid is not None and base <= avoid < base + size):
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


TEST_DATABASE = os.environ.get("LLMSERVER_TEST_DATABASE", "sqlite")
_shared: dict[str, Any] = {}
_databases: dict[Path, str] = {}


def shared_servers() -> tuple[Postgres, Redis]:
    """The session's PostgreSQL and Redis, started on first use and stopped when the tests end."""
    from tests.support.services import Postgres, Redis

    if "postgres" not in _shared:
        _shared["postgres"] = Postgres().start()
        atexit.register(_shared["postgres"].stop)
        _shared["redis"] = Redis().start()
        atexit.register(_shared["redis"].stop)
    return _shared["postgres"], _shared["redis"]


def database_url(data_dir: Path) -> str:
    """The database of the server whose data dir this is."""
    if TEST_DATABASE != "postgresql":
        return f"sqlite:///{data_dir / 'llmserver.db'}"
    data_dir = data_dir.resolve()
    if data_dir not in _databases:
        postgres, _ = shared_servers()
        url = postgres.new_database()
        migrated = subprocess.run(
            [sys.executable, "-m", "llmserver", "db", "migrate", "--database-url", url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert migrated.returncode == 0, migrated.stderr
        _databases[data_dir] = url
    return _databases[data_dir]


def state_env(data_dir: Path) -> dict[str, str]:
    """The environment that points a server or the CLI at the data dir's database (and Redis)."""
    if TEST_DATABASE != "postgresql":
        return {}
    _, redis = shared_servers()
    return {
        "LLMSERVER_STATE__DATABASE_URL": database_url(data_dir),
        "LLMSERVER_STATE__REDIS_URL": redis.url,
        "LLMSERVER_STATE__GATEWAY_ID": "test-" + hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:10],
    }


def cli(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserver", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **state_env(data_dir), **(env or {})},
        check=False,
    )


def create_key(data_dir: Path, name: str, admin: bool = False) -> str:
    result = cli(data_dir, "keys", "create", "--name", name, *(["--admin"] if admin else []))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def spawn(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process writing to `log_path` (appended) that dies with pytest, and so do its instances."""
    with log_path.open("ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)


@dataclass
class Server:
    data_dir: Path
    config: str = ""
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    instance_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"
    namespace: str | None = None  # a network namespace (a test host) to run in, listening on `host`
    extra_args: list[str] = field(default_factory=list)  # more of `serve`'s options
    # The key its instances demand (instance_api_key), so that tests may call llama-server directly;
    # without it a server makes a random one (tests/e2e/test_instance_access.py).
    instance_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def instance_url(self) -> str:
        return f"http://127.0.0.1:{self.instance_port}"

    @property
    def instance_headers(self) -> dict[str, str]:
        """What a direct call to its instances needs."""
        return {"Authorization": f"Bearer {self.env.get('LLMSERVER_INSTANCES__API_KEY', self.instance_key)}"}

    def instance_post(self, path: str, body: object) -> Any:
        """A direct call to its first instance (llama-server's own API): the answer's JSON."""
        return httpx.post(self.instance_url + path, json=body, headers=self.instance_headers, timeout=60).json()

    def start(self, timeout: float = 180.0, keep_port: bool = False) -> Server:
        """Start (`keep_port`: again on the port it had, as a restarted service would)."""
        if not (keep_port and self.port):
            self.port = free_port()
            self.instance_port = free_port_range(4, avoid=self.port)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "llmserver", "serve", "--data-dir", str(self.data_dir), "--port", str(self.port)]
        args += self.extra_args
        if self.namespace is not None:
            args = ["ip", "netns", "exec", self.namespace, *args, "--host", self.host]
        if self.config:
            config_path = self.data_dir / "config.toml"
            config_path.write_text(self.config)
            args += ["--config", str(config_path)]
        ports = {"LLMSERVER_INSTANCES__BASE_PORT": str(self.instance_port)}
        key = {"LLMSERVER_INSTANCES__API_KEY": self.instance_key} if self.instance_key else {}
        env = {**os.environ, **ports, **key, **state_env(self.data_dir), **self.env}
        self.log_path = self.data_dir / "gateway.log"
        self.process = spawn(args, self.log_path, env)
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
    slots = httpx.get(server.instance_url + "/slots", headers=server.instance_headers).json()
    return sum(slot["is_processing"] for slot in slots)


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


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether a server started as `process` answers /ready on `port` within `timeout` (False at once if it exits)."""

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return process.poll() is not None

    return wait_for(ready, timeout) and process.poll() is None


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextmanager
def started(data_dir: Path, config: str) -> Iterator[Server]:
    """A server with `config` in `data_dir`, stopped when the block ends."""
    server = Server(data_dir=data_dir, config=config).start()
    try:
        yield server
    finally:
        server.stop()


def make_key(data_dir: Path, name: str, admin: bool = False, **limits: object) -> str:
    """A key written straight into the server's database (what `keys create` does, without a process)."""
    return make_key_record(data_dir, name, admin, **limits)[1]


def make_key_record(data_dir: Path, name: str, admin: bool = False, **limits: object) -> tuple[str, str]:
    """A key written into the server's database: (its id, the key)."""
    import asyncio

    from llmserver.auth.keys import KeyService
    from llmserver.store import KeyLimits, open_store

    async def create() -> tuple[str, str]:
        store = await open_store(database_url(data_dir))
        try:
            record, key = await KeyService(store).create(name, admin=admin, limits=KeyLimits(**limits))  # type: ignore[arg-type]
            return record.id, key
        finally:
            await store.close()

    return asyncio.run(create())


def use_total_quota(data_dir: Path, key_id: str, tokens: int) -> None:
    """Charge `tokens` to a key's total quota, as finished requests would have."""
    import asyncio

    from llmserver.store import Settlement, UsageBatch, open_store

    async def charge() -> None:
        store = await open_store(database_url(data_dir))
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


def store_rows(data_dir: Path, query: str, *params: object) -> list[dict[str, Any]]:
    """Rows of a query on the server's database, whichever the engine (`?` placeholders)."""
    import asyncio
    import sqlite3

    url = database_url(data_dir)
    if url.startswith("sqlite:"):
        with sqlite3.connect(data_dir / "llmserver.db") as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute(query, params).fetchall()]
    import asyncpg

    numbered = query
    for number in range(1, len(params) + 1):
        numbered = numbered.replace("?", f"${number}", 1)

    async def fetch() -> list[dict[str, Any]]:
        connection = await asyncpg.connect(url)
        try:
            return [dict(row) for row in await connection.fetch(numbered, *params)]
        finally:
            await connection.close()

    return asyncio.run(fetch())


def tls_certificates(folder: Path, addresses: list[str]) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate signed by it for `addresses` (IP or DNS names): the PEM
    files of the CA's certificate, the server's certificate and its key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmserver test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for address in addresses:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, addresses[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def stream(server: Server, key: str, model: str) -> str | None:
    """One streamed chat request; None if it ended well, else what went wrong."""
    body = {"model": model, "stream": True, "max_tokens": 12, "messages": [{"role": "user", "content": "Count."}]}
    try:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {key}"}, timeout=120,
        ) as answer:  # fmt: skip
            if answer.status_code != 200:
                return f"{answer.status_code}: {answer.read().decode()}"
            text = "".join(answer.iter_text())
    except httpx.HTTPError as exc:
        return repr(exc)
    # An error event is a `data: {"error": …}` line (a token of the answer may be the word "error" itself).
    return None if text.rstrip().endswith("data: [DONE]") and 'data: {"error"' not in text else text[-300:]


class SteadyStreams:
    """A steady load: one thread per server given, each sending streamed requests one after another until
    the block ends; `failures` says what went wrong with any of them, `done` how many ended."""

    def __init__(self, servers: list[Server], key: str, model: str) -> None:
        self.failures: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._load, args=(s, key, model)) for s in servers]

    def _load(self, server: Server, key: str, model: str) -> None:
        while not self._stop.is_set():
            outcome = stream(server, key, model)
            if outcome is not None:
                self.failures.append(outcome)
            self.done += 1

    def reach(self, done: int, timeout: float = 60) -> bool:
        """Wait until `done` requests have ended."""
        return wait_for(lambda: self.done >= done, timeout)

    def __enter__(self) -> SteadyStreams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "compose.yaml"


def compose_service(name: str, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A service of deploy/compose/compose.yaml as the tests run it: its command (what follows `llmserver`)
    and its environment, each `${VAR…}` taken from `values` (or its `:-` default). The multi-host tests
    start their nodes and gateways from this, so that the compose stack runs what they test."""
    import re

    import yaml

    def filled(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            variable, operator, fallback = match[1], match[2] or "", match[3] or ""
            if variable in values:
                return values[variable]
            assert operator == ":-", f"compose.yaml needs {variable}: give it in `values`"
            return fallback

        return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, text)

    service = yaml.safe_load(COMPOSE.read_text())["services"][name]
    command = [filled(str(arg)) for arg in service["command"]]
    environment = {key: filled(str(value)) for key, value in service["environment"].items()}
    return command, environment


CHROMIUM = "/usr/bin/chromium"


@contextmanager
def launched_chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright's sync API. While it is open, Playwright's
    event loop runs in this thread: a test that calls asyncio.run must close it first."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("the console tests need Debian's chromium package (scripts/setup.sh --test installs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def assert_error(response: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, object]:
    """An answer in the one error envelope, with this status, type and (if given) param."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    # OpenAI's paths name a context overflow in `code`, as OpenAI's clients read it (docs/api/errors.md).
    openai = response.request.url.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    code = type_ if openai and type_ == "context_length_exceeded" else status
    assert error["type"] == type_ and error["code"] == code and error["message"]
    assert set(error) <= {"message", "type", "code", "param"}
    if param is not None:
        assert error["param"] == param
    return error  # type: ignore[no-any-return]


def with_store(database_url: str, test: Callable[[Store], Awaitable[None]]) -> None:
    async def scenario() -> None:
        store = await open_store(database_url)
        try:
            await test(store)
        finally:
            await store.close()

    asyncio.run(scenario())
