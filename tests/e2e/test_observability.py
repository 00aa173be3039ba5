"""Health, metrics and logs an operator can trust (issue 40), against the real server.

- /ready names each component and turns 503 within 2 s of PostgreSQL or Redis stopping, 200 again
  after they are back; /metrics keeps answering meanwhile, with the outage in it.
- A client's model names never become metric labels.
- `log_format = "json"`: every line is a JSON object; a request's id (the client's X-Request-Id, or one
  made) comes back on the answer and is in the log line of that request.
- A gateway refused at start (port in use, gateway_id held) says so in one line, exits 1, and never
  says it is ready.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import MODEL, Server, cli, free_port, make_key, state_env, wait_for
from tests.support.services import Postgres, Redis

CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 512
threads = 1
"""
TOKEN = "metrics-token-0123456789abcdef"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def component_up(text: str, component: str) -> float | None:
    return samples(text).get(("llmserver_component_up", (("component", component),)))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Postgres, Redis, Server]]:
    """A gateway on its own PostgreSQL and Redis, which the tests stop and start."""
    postgres, redis = Postgres().start(), Redis().start()
    server = None
    try:
        data = tmp_path_factory.mktemp("shared")
        env = {"LLMSERVER_STATE__DATABASE_URL": postgres.new_database(), "LLMSERVER_STATE__REDIS_URL": redis.url,
               "LLMSERVER_OBSERVABILITY__METRICS_TOKEN": TOKEN, "LLMSERVER_STATE__GATEWAY_ID": "observed"}  # fmt: skip
        migrated = cli(data, "db", "migrate", env=env)
        assert migrated.returncode == 0, migrated.stderr
        server = Server(data, CONFIG, env=env).start()
        yield postgres, redis, server
    finally:
        if server is not None:
            server.stop()
        redis.stop()
        postgres.stop()


def test_ready_tells_the_truth_through_a_database_outage_and_metrics_still_answer(
    shared: tuple[Postgres, Redis, Server],
) -> None:
    postgres, _, server = shared
    created = cli(server.data_dir, "keys", "create", "--name", "ops", "--admin", env=server.env)
    assert created.returncode == 0, created.stderr
    admin = created.stdout.strip().splitlines()[-1]
    ready = httpx.get(server.url + "/ready").json()
    assert ready["status"] == "ready" and ready["components"]["database"]["status"] == "up", ready
    # The admin key is confirmed by the database once, before the outage.
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    postgres.halt()
    try:
        stopped = time.monotonic()
        assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 503, 10)
        assert time.monotonic() - stopped < 2.0
        body = httpx.get(server.url + "/ready").json()
        assert body["status"] == "not_ready" and body["components"]["database"]["status"] == "down", body
        assert body["components"]["redis"]["status"] == "up" and body["components"]["models"]["status"] == "up"
        assert httpx.get(server.url + "/health").status_code == 200  # alive: no dependency checked
        for credential in (TOKEN, admin):  # the token without the database; the admin key remembered
            scraped = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {credential}"})
            assert scraped.status_code == 200, scraped.text
            assert component_up(scraped.text, "database") == 0.0
            assert samples(scraped.text)[("llmserver_component_outages_total", (("component", "database"),))] >= 1
        # Neither a wrong token nor an unknown key reads them.
        for wrong in ("not-the-token", "llms-unknown"):
            refused = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {wrong}"})
            assert refused.status_code in (401, 503) and "error" in refused.json()
    finally:
        postgres.resume()
    assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, 15)
    scraped = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert component_up(scraped, "database") == 1.0


def test_ready_names_redis_while_it_is_down(shared: tuple[Postgres, Redis, Server]) -> None:
    _, redis, server = shared
    assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, 15)
    redis.stop()
    try:
        stopped = time.monotonic()
        assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 503, 10)
        assert time.monotonic() - stopped < 2.0
        body = httpx.get(server.url + "/ready").json()
        assert body["components"]["redis"]["status"] == "down" and body["components"]["database"]["status"] == "up"
        scraped = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert scraped.status_code == 200 and component_up(scraped.text, "redis") == 0.0
    finally:
        redis.start()
    assert wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, 15)


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("json-logs")
    server = Server(
        data,
        CONFIG,
        env={"LLMSERVER_OBSERVABILITY__LOG_FORMAT": "json", "LLMSERVER_OBSERVABILITY__METRICS_TOKEN": TOKEN},
    ).start()
    yield server
    server.stop()


def scrape(server: Server) -> str:
    answer = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    return answer.text


def test_a_thousand_unknown_model_names_add_no_series(json_server: Server) -> None:
    key = make_key(json_server.data_dir, "curious")
    headers = {"Authorization": f"Bearer {key}"}
    first = {"model": "first-unknown", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(json_server.url + "/v1/chat/completions", json=first, headers=headers).status_code == 404
    before = scrape(json_server).count("\n")

    async def many() -> list[int]:
        import asyncio

        async with httpx.AsyncClient(base_url=json_server.url, headers=headers, timeout=30) as client:
            semaphore = asyncio.Semaphore(16)

            async def one(n: int) -> int:
                async with semaphore:
                    body = {"model": f"random-{n}", "messages": [{"role": "user", "content": "hi"}]}
                    return (await client.post("/v1/chat/completions", json=body)).status_code

            return await asyncio.gather(*(one(n) for n in range(1000)))

    import asyncio

    assert set(asyncio.run(many())) == {404}
    text = scrape(json_server)
    assert text.count("\n") == before
    assert "random-" not in text
    assert samples(text)[
        ("llmserver_requests_total", (("endpoint", "/v1/chat/completions"), ("model", "(unknown)"),
                                      ("status", "model_not_found")))
    ] >= 1000  # fmt: skip


def test_every_metric_served_is_documented(json_server: Server) -> None:
    """The monitoring page's table lists every family /metrics serves (a node's and a gateway of role
    gateway's: tests/e2e/test_worker_hosts.py)."""
    from tests.test_docs import undocumented

    served = {family.name for family in text_string_to_metric_families(scrape(json_server))}
    assert "llmserver_refusals" in served  # the earlier tests' refusals: a family that appears with its first
    assert undocumented(served) == set()


def test_json_logs_carry_the_request_id_the_client_sent_or_one_made(json_server: Server) -> None:
    key = make_key(json_server.data_dir, "logged")
    sent = "client-request-42"
    answer = httpx.post(
        json_server.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}", "X-Request-Id": sent}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200 and answer.headers["x-request-id"] == sent
    made = httpx.get(json_server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    made_id = made.headers["x-request-id"]
    assert len(made_id) == 16 and made_id != sent
    # An id that could not go into a header or a log line as it is gets replaced.
    odd = httpx.get(json_server.url + "/health", headers={"X-Request-Id": "a b\tc"})
    assert odd.headers["x-request-id"] != "a b\tc"
    refused = httpx.post(
        json_server.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2, "model": "no-such-model"},
        headers={"Authorization": f"Bearer {key}", "X-Request-Id": "refused-1"}, timeout=60,
    )  # fmt: skip
    refusal = refused.json()["error"]

    def lines() -> list[dict[str, object]]:
        return [json.loads(line) for line in json_server.log().splitlines() if line.strip()]

    assert wait_for(lambda: any(line.get("request_id") == made_id for line in lines()), 10)
    records = lines()  # every line parses as JSON
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    access = [r for r in records if r["logger"] == "llmserver.access" and r.get("request_id") == sent]
    assert len(access) == 1, access
    line = access[0]
    assert line["path"] == "/api/generate" and line["status"] == 200 and line["model"] == MODEL
    assert line["key"] and isinstance(line["duration_ms"], float) and line["completion_tokens"] == 2
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's lines: the same format
    (refused_line,) = [r for r in records if r["logger"] == "llmserver.access" and r.get("request_id") == "refused-1"]
    assert refused_line["status"] == refused.status_code == 404  # an error's line says which, and what it said
    assert (refused_line["error_type"], refused_line["error_message"]) == (refusal["type"], refusal["message"])
    assert "error_type" not in line


def test_a_gateway_refused_at_start_says_why_in_one_line_and_never_ready(json_server: Server, tmp_path: Path) -> None:
    """A second gateway on a taken port, and one under a gateway_id a live gateway holds."""
    base = [sys.executable, "-m", "llmserver", "serve", "--data-dir", str(json_server.data_dir)]
    env = {**os.environ, **state_env(json_server.data_dir), "LLMSERVER_INSTANCES__BASE_PORT": str(free_port())}
    taken = subprocess.run([*base, "--port", str(json_server.port)], env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert taken.returncode == 1
    assert "cannot listen on 127.0.0.1" in taken.stderr and "Traceback" not in taken.stderr, taken.stderr
    assert "ready on" not in taken.stderr
    held = subprocess.run(
        [*base, "--port", str(free_port())],
        env={**env, "LLMSERVER_STATE__GATEWAY_LEASE_SECONDS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # The live gateway renews its lease (its own lease period, 10 s): this one waits two of its own and gives up.
    assert held.returncode == 1
    assert "give every gateway that shares the database its own gateway_id" in held.stderr, held.stderr
    assert "Traceback" not in held.stderr and "ready on" not in held.stderr
    assert sum(line.startswith("Error:") for line in held.stderr.splitlines()) == 1, held.stderr
