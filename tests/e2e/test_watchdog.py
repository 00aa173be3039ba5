"""The watchdog, against a real hang: with the pattern check opened up (max_pattern_cost), the issue's
pattern holds llama-server's main loop while its /health keeps answering. The request fails with a
clear 504, the instance is restarted, /ready and /metrics say so, and the model serves again
(issue 39, row 1)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import MODEL, Server, assert_error, create_key, make_key_record, metric, wait_for

pytestmark = pytest.mark.slow

ADMIN = "watchdog-admin-key-0123456789abcdef"
CONFIG = f"""
limits.max_pattern_cost = 1000000000000
instances.stall_timeout = 3
instances.health_interval = 0.5
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
"""
HANGS = "^((a{0,99}){0,99}){0,99}$"


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(data_dir=tmp_path_factory.mktemp("watchdog"), config=CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})
    yield server.start()
    server.stop()


def test_an_instance_that_makes_no_progress_is_restarted(watched: Server) -> None:
    key = create_key(watched.data_dir, "hanging")
    headers = {"Authorization": f"Bearer {key}"}
    instance_url = watched.instance_url
    assert httpx.get(instance_url + "/health").status_code == 200
    body = {
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": HANGS}}},
    }
    not_ready: list[dict[str, object]] = []
    done = threading.Event()

    def watch_ready() -> None:  # the restart takes over a second: /ready is polled through it
        while not done.is_set():
            ready = httpx.get(watched.url + "/ready")
            if ready.status_code == 503:
                not_ready.append(ready.json())
            done.wait(0.05)

    watcher = threading.Thread(target=watch_ready)
    watcher.start()
    try:
        sent = time.monotonic()
        answer = httpx.post(watched.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        failed = time.monotonic()
        error = assert_error(answer, 504, "timeout_error")
        assert "made no progress for" in str(error["message"]) and "restarted" in str(error["message"])
        assert metric(watched, ADMIN, "llmserver_instance_stalls_total", model=MODEL) == 1
        assert wait_for(lambda: httpx.get(watched.url + "/ready").status_code == 200, 60)
        print(f"\n504 after {failed - sent:.1f} s; ready again {time.monotonic() - failed:.1f} s later")
    finally:
        done.set()
        watcher.join()
    assert not_ready and all("made no progress" in str(seen["problems"]) for seen in not_ready), not_ready
    assert "problems" not in httpx.get(watched.url + "/ready").json()
    again = httpx.post(watched.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2}, headers=headers,
                       timeout=120)  # fmt: skip
    assert again.status_code == 200, again.text


def test_an_instance_left_busy_by_a_client_that_went_away_is_restarted(watched: Server) -> None:
    """Issue 54, row 4: the attacker sends a pattern that hangs the instance and disconnects; the watchdog
    looked only while requests were in flight, so the next key's request waited its whole queue timeout.
    Now the instance is restarted with nothing in flight, and the key that sent it is counted."""
    assert wait_for(lambda: httpx.get(watched.url + "/ready").status_code == 200, 60)
    key_id, key = make_key_record(watched.data_dir, "leaves")
    body = {
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": HANGS}}},
    }
    before = metric(watched, ADMIN, "llmserver_instance_stalls_total", model=MODEL)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(watched.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=1.0)  # fmt: skip
    assert wait_for(lambda: metric(watched, ADMIN, "llmserver_instance_stalls_total", model=MODEL) == before + 1, 60)
    assert metric(watched, ADMIN, "llmserver_instance_stalls_by_key_total", model=MODEL, key=key_id) == 1
    other = create_key(watched.data_dir, "next")
    sent = time.monotonic()
    answer = httpx.post(watched.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {other}"}, timeout=120)  # fmt: skip
    assert answer.status_code == 200, answer.text
    print(f"\nthe next key's request answered {time.monotonic() - sent:.1f} s after the restart")
