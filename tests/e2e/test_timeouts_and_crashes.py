"""The generation timeout, and an instance that dies under the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from llmserver.models.files import embedded_model_path
from tests.support import COUNTING, MODEL, Server, create_key, pids_of_children_named, wait_for

# Each test here starts servers of its own or waits on timers: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

SHORT_TIMEOUT = f'limits.request_timeout = 1.0\n[[models]]\nname = "{MODEL}"\nparallel = 2\nctx_size = 1024\n'
# Greedy decoding of this prompt runs to max_tokens: 300 tokens, about 3 s on 2 cores.
LONG = {"prompt": COUNTING, "raw": True, "max_tokens": 300, "temperature": 0}
STREAM = {"prompt": COUNTING, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    data_dir = tmp_path_factory.mktemp("impatient")
    server = Server(data_dir=data_dir, config=SHORT_TIMEOUT).start()
    yield server, create_key(data_dir, "k")
    server.stop()


def test_generation_over_the_timeout_is_504(impatient: tuple[Server, str]) -> None:
    server, key = impatient
    response = httpx.post(
        server.url + "/api/generate", json=LONG, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    assert "1 s" in response.json()["error"]["message"]


def test_stream_over_the_timeout_ends_with_an_error_event(impatient: tuple[Server, str]) -> None:
    server, key = impatient
    body = {**STREAM, "max_tokens": 300}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last == {"error": {"message": last["error"]["message"], "type": "timeout_error", "code": 504}}
    assert len(lines) > 3  # it did stream before the timeout


def test_a_killed_instance_is_replaced(start_server: Callable[..., Server]) -> None:
    server = start_server(f'[[models]]\nname = "{MODEL}"\nparallel = 1\nctx_size = 512\n')
    assert server.process is not None
    (child,) = pids_of_children_named("llama-server", server.process.pid)
    os.kill(child, signal.SIGKILL)
    pid = server.process.pid
    replaced = lambda: [p for p in pids_of_children_named("llama-server", pid) if p != child]  # noqa: E731
    assert wait_for(lambda: replaced() and httpx.get(server.url + "/ready").status_code == 200, 30), server.log()
    assert server.generate_ok()
    assert "died with code -9; restarting it" in server.log()


def test_instance_dying_mid_stream_ends_it_with_an_error_event(impatient: tuple[Server, str]) -> None:
    server, key = impatient
    assert server.process is not None
    body = {**STREAM, "max_tokens": 50}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(3)]
        for pid in pids_of_children_named("llama-server", server.process.pid):
            os.kill(pid, signal.SIGKILL)
        seen += [line for line in lines if line]
    assert seen[-1] == "data: [DONE]"
    error = json.loads(seen[-2].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, 30)


def test_crash_looping_instance_is_given_up(start_server: Callable[..., Server]) -> None:
    config = (
        "instances.restart_max_failures = 2\ninstances.restart_window = 60\n"
        f'[[models]]\nname = "{MODEL}"\nctx_size = 512\n'
    )
    server = start_server(config)
    assert server.process is not None
    (first,) = pids_of_children_named("llama-server", server.process.pid)
    os.kill(first, signal.SIGKILL)  # failure 1: restarted
    assert wait_for(lambda: [p for p in pids_of_children_named("llama-server", server.process.pid) if p != first], 20)
    assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, 20)
    (second,) = pids_of_children_named("llama-server", server.process.pid)
    os.kill(second, signal.SIGKILL)  # failure 2 within the window: given up
    assert wait_for(lambda: "giving up on it after 2 failures within 60 s" in server.log(), 10)
    pid = server.process.pid
    assert wait_for(lambda: pids_of_children_named("llama-server", pid) == [], 10)
    assert httpx.get(server.url + "/ready").status_code == 503
    refused = httpx.post(
        server.url + "/api/generate",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {create_key(server.data_dir, 'k')}"},
        timeout=10,
    )
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"


def test_instance_that_cannot_restart_is_given_up(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    model_file = tmp_path / "copy.gguf"
    shutil.copyfile(embedded_model_path(), model_file)
    config = f'instances.restart_max_failures = 3\n[[models]]\nname = "copy"\npath = "{model_file}"\nctx_size = 512\n'
    server = start_server(config, data_dir=tmp_path / "data")
    assert server.process is not None
    (child,) = pids_of_children_named("llama-server", server.process.pid)
    model_file.unlink()  # every restart now fails: llama-server cannot load the model
    os.kill(child, signal.SIGKILL)
    assert wait_for(lambda: "failed to restart; giving up on it after 3 failures" in server.log(), 30), server.log()
    assert "restart of instance" in server.log()
    assert httpx.get(server.url + "/ready").status_code == 503
