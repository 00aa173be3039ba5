"""Models on demand, against real servers: the embedded model under two names, `a` (kept running)
and `b` (started on its first request, stopped when idle), with and without a memory budget that
holds only one instance."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import COUNTING, Server, assert_error, make_key, metric, wait_for

MODELS = """
[[models]]
name = "a"
parallel = 1
ctx_size = 512
threads = 1
idle_timeout = 5

[[models]]
name = "b"
min_instances = 0
parallel = 1
ctx_size = 512
threads = 1
idle_timeout = 5
"""
# One instance of the embedded model measures ~142 MiB here; two do not fit in 200.
ONE_INSTANCE_BUDGET = "instances.memory_budget_mb = 200\n"


def instances(server: Server, admin: str, model: str) -> list[dict[str, Any]]:
    answer = httpx.get(server.url + "/api/instances", headers={"Authorization": f"Bearer {admin}"})
    return [i for i in answer.json()["data"] if i["model"] == model and i["status"] != "stopped"]


def generate(server: Server, key: str, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Say hi.", "max_tokens": 4, **fields}
    return httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_a_cold_model_starts_on_first_request_and_stops_when_idle(start_server: Callable[..., Server]) -> None:
    server = start_server("limits.queue_timeout = 60\n" + MODELS)
    admin = make_key(server.data_dir, "admin", admin=True)
    assert httpx.get(server.url + "/ready").status_code == 200  # b at zero does not hold readiness back
    assert instances(server, admin, "b") == []
    started = time.monotonic()
    answer = generate(server, admin, "b")
    cold = time.monotonic() - started
    assert answer.status_code == 200 and answer.json()["model"] == "b", answer.text
    assert metric(server, admin, "llmserver_cold_starts_total", model="b") == 1
    assert 0 < metric(server, admin, "llmserver_cold_start_seconds_total", model="b") <= cold
    assert "cold start of b" in server.log()
    print(f"cold start of the embedded model: first request answered in {cold:.2f} s")
    # idle_timeout (5 s) later, b is back to zero; a stays at its min_instances
    assert wait_for(lambda: instances(server, admin, "b") == [], timeout=20)
    assert len(instances(server, admin, "a")) == 1


def test_ten_first_requests_start_one_instance(start_server: Callable[..., Server]) -> None:
    server = start_server(
        "limits.queue_timeout = 60\n" + MODELS.replace('name = "b"\n', 'name = "b"\nmax_instances = 2\n')
    )
    admin = make_key(server.data_dir, "admin", admin=True)
    with concurrent.futures.ThreadPoolExecutor(10) as workers:
        answers = list(workers.map(lambda _: generate(server, admin, "b", max_tokens=2), range(10)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    seen = {a.json()["instance_id"] for a in answers}
    assert metric(server, admin, "llmserver_cold_starts_total", model="b") == 1
    assert len(seen) <= 2  # one cold start, perhaps one more for the queue behind it: not ten


def test_keep_alive_holds_an_instance_past_idle_timeout(start_server: Callable[..., Server]) -> None:
    server = start_server("limits.queue_timeout = 60\nlimits.max_keep_alive = 30\n" + MODELS)
    admin = make_key(server.data_dir, "admin", admin=True)
    assert generate(server, admin, "b", keep_alive=12).status_code == 200
    time.sleep(8)  # past idle_timeout (5 s), within keep_alive
    assert len(instances(server, admin, "b")) == 1
    assert wait_for(lambda: instances(server, admin, "b") == [], timeout=20)
    assert_error(generate(server, admin, "b", keep_alive=31), 400, "invalid_request_error", "keep_alive")


def test_under_a_one_instance_budget_models_swap(start_server: Callable[..., Server]) -> None:
    server = start_server("limits.queue_timeout = 60\n" + ONE_INSTANCE_BUDGET + MODELS)
    admin = make_key(server.data_dir, "admin", admin=True)
    swaps = []
    for model in ("b", "a", "b", "a"):
        started = time.monotonic()
        answer = generate(server, admin, model)
        swaps.append(time.monotonic() - started)
        assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
        other = "a" if model == "b" else "b"
        assert instances(server, admin, other) == []  # it was stopped to make room
    assert metric(server, admin, "llmserver_evictions_total", model="a") == 2
    assert metric(server, admin, "llmserver_evictions_total", model="b") == 2
    print("swap times (s): " + ", ".join(f"{s:.2f}" for s in swaps))


def test_an_instance_with_a_stream_in_flight_is_never_evicted(start_server: Callable[..., Server]) -> None:
    server = start_server("limits.queue_timeout = 60\n" + ONE_INSTANCE_BUDGET + MODELS)
    admin = make_key(server.data_dir, "admin", admin=True)
    (a_instance,) = instances(server, admin, "a")
    streamed: list[str] = []

    def stream() -> None:
        body = {"model": "a", "prompt": COUNTING, "max_tokens": 300, "stream": True, "temperature": 0}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body,
            headers={"Authorization": f"Bearer {admin}"}, timeout=120,
        ) as response:  # fmt: skip
            for line in response.iter_lines():
                streamed.append(line)

    thread = threading.Thread(target=stream)
    thread.start()
    assert wait_for(lambda: len(streamed) > 3, timeout=30)
    started = time.monotonic()
    answer = generate(server, admin, "b")  # waits: a's instance is busy, and nothing else can be freed
    waited = time.monotonic() - started
    thread.join(timeout=120)
    assert "data: [DONE]" in streamed and not any('"error"' in line for line in streamed)
    assert answer.status_code == 200, answer.text
    assert waited > 1.0  # it waited for the stream to end rather than cutting it
    # a's instance was stopped for b only once its stream had ended
    assert f"stopping idle instance {a_instance['instance_id']}" in server.log()
    assert instances(server, admin, "a") == []


def test_a_model_that_cannot_start_in_time_is_503_saying_why(start_server: Callable[..., Server]) -> None:
    server = start_server("limits.queue_timeout = 3\n" + ONE_INSTANCE_BUDGET + MODELS)
    admin = make_key(server.data_dir, "admin", admin=True)
    hold = threading.Thread(
        target=lambda: generate(server, admin, "a", prompt=COUNTING, raw=True, max_tokens=400, temperature=0)
    )
    hold.start()
    assert wait_for(lambda: instances(server, admin, "a")[0]["active_users"] == 1, timeout=30)
    refused = generate(server, admin, "b")
    hold.join(timeout=120)
    error = assert_error(refused, 503, "overloaded_error")
    assert "memory budget" in str(error["message"]) and refused.headers["retry-after"]


@pytest.fixture
def allow_a_only(start_server: Callable[..., Server]) -> tuple[Server, str]:
    server = start_server(MODELS)
    return server, make_key(server.data_dir, "only-a", models=("a",))


def test_a_key_limited_to_some_models(allow_a_only: tuple[Server, str]) -> None:
    server, key = allow_a_only
    assert generate(server, key, "a").status_code == 200
    error = assert_error(generate(server, key, "b"), 403, "permission_error", "model")
    assert "'b'" in str(error["message"])
    listed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [model["id"] for model in listed] == ["a"]
    chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"})
    assert_error(answer, 403, "permission_error", "model")
