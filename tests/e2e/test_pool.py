"""The instance pool with real llama-server children: routing, admission, scaling, recovery, the API."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx
import psutil
import pytest

from tests.support import COUNTING, MODEL, Server, cli, make_key, metric, store_rows, wait_for

# Each test here starts servers of its own or waits on timers: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

ADMIN = "test-admin-key-0123456789"
# Two models on the same GGUF file. MODEL: two fixed instances. "smol-b": one to two instances,
# one slot each, a queue of one, and a short idle timeout.
POOL_CONFIG = f"""
limits.max_concurrency_per_key = 4
instances.health_interval = 0.5

[[models]]
name = "{MODEL}"
min_instances = 2
max_instances = 2
parallel = 2
ctx_size = 512

[[models]]
name = "smol-b"
min_instances = 1
max_instances = 2
parallel = 1
instance_queue = 0
max_queue = 1
idle_timeout = 5
ctx_size = 512
"""
# One instance of one slot, which llama-server is handed one more request for (its own queue).
INSTANCE_QUEUE_CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 1
instance_queue = 1
max_queue = 1
ctx_size = 512
"""

INSTANCE_FIELDS = {
    "instance_id": str,
    "model": str,
    "status": str,
    "host": str,
    "port": int,
    "pid": int,
    "active_users": int,
    "ram_used_mb": int,
    "cpu_percent": float,
    "uptime_seconds": int,
    "last_activity": str,
}
# Greedy decoding of this prompt runs to max_tokens.
LONG_PROMPT = "Count from 1 to 1000, separated by commas."


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        data_dir=tmp_path_factory.mktemp("pool"), config=POOL_CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN}
    ).start()
    yield server
    server.stop()


def admin(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)


def instances(server: Server, model: str | None = None) -> list[dict[str, Any]]:
    with admin(server) as client:
        data: list[dict[str, Any]] = client.get("/api/instances").json()["data"]
    return [i for i in data if model is None or i["model"] == model]


def generate(server: Server, key: str, model: str, max_tokens: int = 40, prompt: str = LONG_PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_instance_records_are_the_seeds(pool: Server) -> None:
    listed = instances(pool)
    assert sorted(i["model"] for i in listed) == [MODEL, MODEL, "smol-b"]
    for record in listed:
        assert set(record) == set(INSTANCE_FIELDS)
        for name, kind in INSTANCE_FIELDS.items():
            assert type(record[name]) is kind, (name, record[name])
        assert record["status"] == "ready" and record["host"] == "127.0.0.1"
        process = psutil.Process(record["pid"])
        assert process.name() == "llama-server"
        command = " ".join(process.cmdline())
        assert (
            f"--port {record['port']}" in command and "--cache-ram 0" in command
        )  # prompt_cache.isolation = "key": no RAM cache and "--threads 1" in command
        assert record["ram_used_mb"] > 0
        assert datetime.fromisoformat(record["last_activity"]).utcoffset() is not None
    with admin(pool) as client:
        one = client.get(f"/api/instances/{listed[0]['instance_id']}").json()
        assert one["instance_id"] == listed[0]["instance_id"]
        missing = client.get("/api/instances/nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_an_instance_s_log_tail_is_bounded_and_holds_no_key(pool: Server) -> None:
    """The last lines of an instance's llama-server log, as the console shows them: its start line (the
    command llmserver ran) and llama-server's own lines; the instance key never in it."""
    one = instances(pool, MODEL)[0]
    with admin(pool) as client:
        answer = client.get(f"/api/instances/{one['instance_id']}/log")
        assert answer.status_code == 200, answer.text
        tail = answer.json()
        assert tail["instance_id"] == one["instance_id"] and tail["model"] == MODEL
        assert 1 < len(tail["lines"]) <= 100 and any("starting:" in line for line in tail["lines"])
        assert all(pool.instance_key not in line for line in tail["lines"])
        assert len(client.get(f"/api/instances/{one['instance_id']}/log", params={"lines": 3}).json()["lines"]) == 3
        for lines in (0, 1001, "many"):
            refused = client.get(f"/api/instances/{one['instance_id']}/log", params={"lines": lines})
            assert refused.status_code == 400, (lines, refused.text)
            error = refused.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "lines")
        assert client.get("/api/instances/nope/log").status_code == 404


def test_instance_api_is_for_admins_only(pool: Server) -> None:
    key = make_key(pool.data_dir, "plain")
    headers = {"Authorization": f"Bearer {key}"}
    for method, path in [
        ("GET", "/api/instances"),
        ("GET", "/api/instances/x"),
        ("POST", "/api/instances"),
        ("DELETE", "/api/instances/x"),
        ("GET", "/api/instances/x/log"),
    ]:
        response = httpx.request(method, pool.url + path, headers=headers, json={"model": MODEL})
        assert response.status_code == 403, (method, path)
        assert response.json()["error"]["type"] == "permission_error"
    assert httpx.get(pool.url + "/api/instances").status_code == 401
    cli_admin = make_key(pool.data_dir, "db-admin", admin=True)
    assert httpx.get(pool.url + "/api/instances", headers={"Authorization": f"Bearer {cli_admin}"}).status_code == 200


def test_requests_spread_over_instances_and_models(pool: Server) -> None:
    keys = [make_key(pool.data_dir, f"spread-{n}") for n in range(3)]
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        futures = [executor.submit(generate, pool, keys[n % 2], MODEL, 24) for n in range(8)]
        other = generate(pool, keys[2], "smol-b", 4)
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    used = {r.json()["instance_id"] for r in responses}
    assert used == {i["instance_id"] for i in instances(pool, MODEL)}
    assert other.status_code == 200
    assert other.json()["instance_id"] == instances(pool, "smol-b")[0]["instance_id"]


@contextlib.contextmanager
def running_stream(server: Server, key: str, model: str) -> Iterator[Iterator[str]]:
    """A long streamed generation that is running (its first event arrived) until the block ends;
    the rest of its lines, for a test that reads it to the end."""
    body = {"model": model, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping the iterator would close the stream
        next(lines)
        yield lines


def test_per_key_concurrency_limit_is_429(pool: Server) -> None:
    key = make_key(pool.data_dir, "greedy", max_concurrency=2)
    with running_stream(pool, key, MODEL), running_stream(pool, key, MODEL):
        limited = generate(pool, key, MODEL, 4)  # a third one while two are in flight
        assert limited.status_code == 429, limited.text
        error = limited.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == 429
        assert limited.headers["Retry-After"] == "1"
    # Both places come back once the server has seen the streams' clients go.
    assert wait_for(lambda: generate(pool, key, MODEL, 4).status_code == 200, 15)


def test_full_queue_is_503_and_queueing_scales_up_then_idle_scales_down(pool: Server) -> None:
    keys = [make_key(pool.data_dir, f"queue-{n}") for n in range(4)]
    queued = lambda: metric(pool, ADMIN, "llmserver_queue_depth", model="smol-b")  # noqa: E731
    with running_stream(pool, keys[0], "smol-b"), concurrent.futures.ThreadPoolExecutor(1) as executor:
        waiting = executor.submit(generate, pool, keys[1], "smol-b", 8)  # the queue's one place
        assert wait_for(lambda: queued() == 1, 30)
        full = [generate(pool, key, "smol-b", 8) for key in keys[2:]]
        assert [r.status_code for r in full] == [503, 503], [r.text for r in full]
        assert full[0].json()["error"]["type"] == "overloaded_error" and int(full[0].headers["Retry-After"]) >= 1
    assert waiting.result().status_code == 200  # served once the stream let its slot go
    # The queueing started a second instance (max_instances = 2) ...
    assert wait_for(lambda: len(instances(pool, "smol-b")) == 2, 30)
    # ... which stops again after idle_timeout (5 s) without traffic, back to min_instances = 1.
    assert wait_for(lambda: len(instances(pool, "smol-b")) == 1, 30), instances(pool, "smol-b")


def test_a_request_beyond_the_slots_waits_in_the_instances_own_queue(start_server: Callable[..., Server]) -> None:
    server = start_server(INSTANCE_QUEUE_CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})
    keys = [make_key(server.data_dir, f"instance-queue-{n}") for n in range(5)]
    in_flight = lambda: metric(server, ADMIN, "llmserver_in_flight", model=MODEL)  # noqa: E731
    queued = lambda: metric(server, ADMIN, "llmserver_queue_depth", model=MODEL)  # noqa: E731
    (record,) = instances(server)
    assert "--parallel 1 --threads-http 6" in " ".join(psutil.Process(record["pid"]).cmdline())
    with running_stream(server, keys[0], MODEL), concurrent.futures.ThreadPoolExecutor(2) as executor:
        # Its one slot is streaming: the next request is handed to llama-server all the same ...
        at_instance = executor.submit(generate, server, keys[1], MODEL, 8)
        assert wait_for(lambda: in_flight() == 2, 30)
        assert queued() == 0
        # ... and one whose client gives up there gives its place back (llama-server drops it).
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/api/generate",
                json={"prompt": "Say hi.", "max_tokens": 8},
                headers={"Authorization": f"Bearer {keys[2]}"},
                timeout=1.0,
            )
        waiting = executor.submit(generate, server, keys[3], MODEL, 8)  # the gateway's queue, of one
        assert wait_for(lambda: queued() == 1, 30)
        full = generate(server, keys[4], MODEL, 8)
        assert full.status_code == 503 and full.json()["error"]["type"] == "overloaded_error"
        assert in_flight() == 2 and not at_instance.done()  # still waiting for the stream's slot
    # The stream's client left: its slot goes to the request llama-server held, then to the queue's.
    assert at_instance.result().status_code == 200 and waiting.result().status_code == 200
    assert wait_for(lambda: in_flight() == 0, 10)
    outcomes = lambda: sorted(  # noqa: E731
        row["outcome"]
        for row in store_rows(server.data_dir, "SELECT outcome FROM usage_ledger WHERE endpoint = ?", "/api/generate")
    )
    assert wait_for(lambda: len(outcomes()) == 4, 10)
    assert outcomes() == ["client_closed_request", "ok", "ok", "overloaded_error"]


def test_start_and_drain_through_the_api(pool: Server) -> None:
    with admin(pool) as client:
        at_max = client.post("/api/instances", json={"model": MODEL})
        assert at_max.status_code == 400 and "max_instances" in at_max.json()["error"]["message"]
        unknown = client.post("/api/instances", json={"model": "nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"
        started = client.post("/api/instances", json={"model": "smol-b"})
        assert started.status_code == 201, started.text
        record = started.json()
        assert record["status"] == "ready" and psutil.pid_exists(record["pid"])
        key = make_key(pool.data_dir, "drainee")
        # Occupy both smol-b instances (one slot each), then drain the new one: its stream must finish.
        with running_stream(pool, key, "smol-b") as first, running_stream(pool, key, "smol-b") as second:
            assert all(i["status"] == "busy" for i in instances(pool, "smol-b"))
            drained = client.delete(f"/api/instances/{record['instance_id']}")
            for lines in (first, second):
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
        assert drained.status_code == 200 and drained.json()["status"] == "stopped"
        assert wait_for(lambda: not psutil.pid_exists(record["pid"]), 10)
        assert client.get(f"/api/instances/{record['instance_id']}").status_code == 404


def test_killed_instance_loses_no_request(pool: Server) -> None:
    keys = [make_key(pool.data_dir, f"survivor-{n}") for n in range(2)]
    victim = instances(pool, MODEL)[0]
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        futures = [executor.submit(generate, pool, keys[n % 2], MODEL, 60) for n in range(8)]
        assert wait_for(lambda: any(i["active_users"] for i in instances(pool, MODEL) if i["pid"] == victim["pid"]), 30)
        os.kill(victim["pid"], signal.SIGKILL)
        responses = [f.result(timeout=120) for f in futures]
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert wait_for(
        lambda: any(
            i["instance_id"] == victim["instance_id"] and i["status"] == "ready" and i["pid"] != victim["pid"]
            for i in instances(pool, MODEL)
        ),
        30,
    )
    assert "died with code -9; restarting it" in pool.log()


def test_hung_instance_is_replaced(pool: Server) -> None:
    """smol-b's one instance hangs: it is replaced; meanwhile the gateway stays ready (MODEL serves), its
    /ready naming smol-b as not serving — one model's trouble is never the load balancer's."""
    victim = instances(pool, "smol-b")[0]
    os.kill(victim["pid"], signal.SIGSTOP)  # alive but silent: only a real probe notices
    try:
        seen: list[httpx.Response] = []

        def smol_b_down() -> bool:
            seen.append(httpx.get(pool.url + "/ready"))
            return seen[-1].json()["models"]["smol-b"] is False

        assert wait_for(smol_b_down, 15)
        assert seen[-1].status_code == 200 and seen[-1].json()["models"][MODEL] is True
        assert "smol-b" in seen[-1].json()["components"]["models"]["detail"]
        assert wait_for(
            lambda: any(i["pid"] != victim["pid"] and i["status"] == "ready" for i in instances(pool, "smol-b")), 30
        )
        assert all(ready.status_code == 200 for ready in seen)
        assert httpx.get(pool.url + "/ready").json()["models"] == {MODEL: True, "smol-b": True}
    finally:
        if psutil.pid_exists(victim["pid"]):
            os.kill(victim["pid"], signal.SIGCONT)


def test_instances_command_prints_the_table(pool: Server) -> None:
    result = cli(pool.data_dir, "instances", "--url", pool.url, "--key", ADMIN)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "ID",
        "MODEL",
        "STATUS",
        "NODE",
        "HOST",
        "PORT",
        "PID",
        "USERS",
        "RAM_MB",
        "CPU%",
        "UPTIME_S",
        "LAST_ACTIVITY",
    ]
    listed = instances(pool)
    assert sorted(row.split()[0] for row in rows) == sorted(i["instance_id"] for i in listed)
    assert {row.split()[3] for row in rows} == {"-"}  # instances of this gateway's own: no node
    as_json = cli(pool.data_dir, "instances", "--url", pool.url, "--json", env={"LLMSERVER_API_KEY": ADMIN})
    assert {r["instance_id"] for r in json.loads(as_json.stdout)} == {i["instance_id"] for i in listed}
    refused = cli(pool.data_dir, "instances", "--url", pool.url, "--key", "nope")
    assert refused.returncode == 1 and refused.stderr == "Error: Invalid API key (401 authentication_error)\n"
