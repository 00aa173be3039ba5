"""Starting and stopping: the child is healthy before we serve, and gone after we stop."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support import (
    COUNTING,
    MODEL,
    Server,
    busy_slots,
    documents,
    make_key,
    pids_of_children_named,
    process_alive,
    wait_for,
)

# Each test here starts servers of its own or waits on timers: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

ONE_SMALL_INSTANCE = f'[[models]]\nname = "{MODEL}"\nparallel = 1\nctx_size = 512\n'


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_leaves_no_llama_server(tmp_path: Path, sig: signal.Signals, start_server: Callable[..., Server]) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    server = start_server(ONE_SMALL_INSTANCE, env={"TMPDIR": str(temp)})
    assert server.process is not None
    children = pids_of_children_named("llama-server", server.process.pid)
    assert len(children) == 1
    assert server.generate_ok()
    assert any(temp.iterdir())  # the forkserver's socket folder and the converters' private TMPDIR
    # A finished stop is a clean exit (uvicorn re-raises the signal; `serve` turns that into status 0),
    # so Python's exit handlers run and nothing is left in TMPDIR.
    assert server.stop(sig) == 0
    assert list(temp.iterdir()) == []
    assert _wait_gone(children[0])
    logs = list((tmp_path / "logs").glob("*.log"))
    assert logs and "llama" in logs[0].read_text(errors="replace").lower()  # the child's output went to its log file
    assert "all instances stopped" in server.log()


def test_a_tmpdir_too_long_for_a_socket_path_still_starts_and_reads_files(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    """The document converters' forkserver listens on a UNIX socket under TMPDIR, whose path holds at most 107
    bytes: under a longer TMPDIR the server used to exit at start ("AF_UNIX path too long"). Its private folder
    and its socket now go under /tmp then, and are removed at the stop like the rest."""
    temp = tmp_path / ("t" * 80)
    temp.mkdir()
    before = set(Path("/tmp").glob("llmserver-extract-*"))
    server = start_server(ONE_SMALL_INSTANCE, env={"TMPDIR": str(temp)})
    private = set(Path("/tmp").glob("llmserver-extract-*")) - before
    assert len(private) == 1
    headers = {"Authorization": f"Bearer {make_key(server.data_dir, 'files')}"}
    tokens = []
    for parts in ([], [documents.file_part("report.docx", documents.make_docx())]):
        body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}], "max_tokens": 1}
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        tokens.append(answer.json()["usage"]["prompt_tokens"])
    assert tokens[1] > tokens[0] + 5  # the document's text reached the prompt
    assert server.stop() == 0
    assert not any(folder.exists() for folder in private)


def test_killed_gateway_takes_its_child_along(start_server: Callable[..., Server]) -> None:
    server = start_server(ONE_SMALL_INSTANCE)
    assert server.process is not None
    (child,) = pids_of_children_named("llama-server", server.process.pid)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    assert _wait_gone(child, timeout=20)


def test_missing_model_file_fails_start_clearly(tmp_path: Path) -> None:
    server = Server(data_dir=tmp_path, config='[[models]]\nname = "ghost"\npath = "/nonexistent/ghost.gguf"\n')
    with pytest.raises(RuntimeError) as caught:
        server.start(timeout=60)
    assert "GGUF file not found: /nonexistent/ghost.gguf" in str(caught.value)


def test_health_and_ready(server: Server) -> None:
    health = httpx.get(server.url + "/health")
    assert health.json() == {"status": "ok"}
    assert "server" not in health.headers and "date" in health.headers  # no banner for probes
    ready = httpx.get(server.url + "/ready")
    body = ready.json()
    assert ready.status_code == 200 and body["status"] == "ready" and body["models"] == {MODEL: True}
    # What it checked, each component by name (a single server: its database and its models).
    assert {name: c["status"] for name, c in body["components"].items()} == {"database": "up", "models": "up"}


def test_sigterm_lets_in_flight_requests_finish(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    server = start_server(ONE_SMALL_INSTANCE)
    key = make_key(tmp_path, "k")
    body = {"prompt": COUNTING, "raw": True, "max_tokens": 120, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        pending = executor.submit(
            httpx.post, server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        assert wait_for(lambda: busy_slots(server) == 1, 30)  # generating
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200 and response.json()["completion_tokens"] == 120
    assert server.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
