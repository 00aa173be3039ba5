"""Shared fixtures. `server` is one real llmserver (real llama-server, embedded model) per session."""

from __future__ import annotations

import collections
import json
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


# Each module's seconds in a run on two workers (its tests' setup, call and teardown), written by
# `pytest --save-durations`: the order the workers are handed the modules in (below). A module not in it
# counts a second a test, or ten minutes if it holds slow tests.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--save-durations", action="store_true", help=f"write each module's seconds to {DURATIONS.name}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadscope`), the longest modules first (tests/durations.json): the
    workers take modules whole, in this order, so the long ones start early and short ones fill the end
    rather than one worker finishing a long module alone. A serial run keeps the files' order.
    (`--no-loadscope-reorder` keeps this order: xdist's own hands out the modules with the most tests
    first, which put the slow ones, a test or two each, last.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    module = {item: item.nodeid.split("::")[0] for item in items}
    slow = {module[item] for item in items if item.get_closest_marker("slow")}
    tests = collections.Counter(module.values())
    expected = {name: known.get(name, 600.0 if name in slow else float(count)) for name, count in tests.items()}
    items.sort(key=lambda item: -expected[module[item]])


_spent: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[report.nodeid.split("::")[0]] += report.duration  # under xdist the controller sees every report


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("save_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        spent = {name: round(seconds, 1) for name, seconds in sorted(_spent.items())}
        DURATIONS.write_text(json.dumps(spent, indent=0) + "\n")


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
