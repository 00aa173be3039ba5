"""Shared fixtures. `server` is one real llmserver (real llama-server, embedded model) per session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import MODEL, THREADS, Server, create_key, launched_chromium, shared_servers
from tests.support.services import Postgres, Redis

# A small per-request context so that the context-length limit is cheap to hit.
TEST_CONFIG = f"""
limits.max_tokens = 512
server.max_request_bytes = 25165824  # 24 MiB: room for one 16 MB file, base64-encoded

[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = {THREADS}
"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadscope`), the modules that hold slow tests first: the workers take
    modules whole, in this order, so the long ones start early and short ones fill the end rather than one
    worker finishing a long module alone. A serial run keeps the files' order. (`--no-loadscope-reorder`
    keeps this order: by default xdist hands out the modules with the most tests first, which put the
    slow ones, a test or two each, last.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """Debian's Chromium for a module of console tests (its event loop runs the while: no asyncio.run)."""
    with launched_chromium() as browser:
        yield browser


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(data_dir=tmp_path_factory.mktemp("server"), config=TEST_CONFIG).start()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def api_key(server: Server) -> str:
    return create_key(server.data_dir, "tests")


@pytest.fixture(scope="session")
def client(server: Server, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120) as c:
        yield c


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start real servers for one test; every one is stopped at teardown, whatever the test did."""
    started: list[Server] = []

    def start(config: str = "", *, data_dir: Path | None = None, env: dict[str, str] | None = None) -> Server:
        server = Server(data_dir=data_dir or tmp_path, config=config, env=env or {})
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Postgres:
    """A private PostgreSQL server for the session (each test takes a fresh database from it)."""
    return shared_servers()[0]


@pytest.fixture(scope="session")
def redis_server() -> Redis:
    return shared_servers()[1]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each engine (PostgreSQL's migrated)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server: Postgres = request.getfixturevalue("postgres")
    url = server.new_database()
    result = subprocess.run(
        [sys.executable, "-m", "llmserver", "db", "migrate", "--database-url", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return url
