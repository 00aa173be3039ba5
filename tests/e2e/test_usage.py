"""Quotas under concurrency, the ledger, the 30-day speed on /v1/models, /metrics — on the real server."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import MODEL, Server, cli, make_key, store_rows, wait_for

# Each test here starts servers of its own or waits on timers: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

ADMIN = "usage-admin-key-0123456789"
CONFIG = f'[[models]]\nname = "{MODEL}"\nparallel = 4\nctx_size = 1024\n'
QUOTA = 900


def ledger(data_dir: Path, key_id: str | None = None) -> list[dict[str, Any]]:
    rows = store_rows(data_dir, "SELECT * FROM usage_ledger ORDER BY id")
    return [r for r in rows if key_id is None or r["key_id"] == key_id]


def key_id_of(data_dir: Path, name: str) -> str:
    listed = json.loads(cli(data_dir, "keys", "list", "--json").stdout)
    return str(next(k["id"] for k in listed if k["name"] == name))


def fire(server: Server, key: str, n: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        if i % 2:
            body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": True}
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as r:
                r.read()
                return r
        return httpx.post(
            server.url + "/api/generate", json={"prompt": "Say hi.", "max_tokens": 8}, headers=headers, timeout=120
        )

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_quota_holds_under_concurrency_and_survives_restart(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    server = start_server(CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})
    key = make_key(tmp_path, "quota", quota_tokens=QUOTA, quota_period="day", max_concurrency=64)
    key_id = key_id_of(tmp_path, "quota")
    answered = 0
    for round_ in (1, 2):
        responses = fire(server, key, 40)
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert ok and refused, [r.status_code for r in responses]
        for r in refused:
            assert r.status_code == 429 and json.loads(r.read())["error"]["type"] == "insufficient_quota"
            assert int(r.headers["Retry-After"]) > 0
        answered += len(ok)
        fired = 40 * round_
        # Ledger rows are written just after each response goes out: every request is one, refused
        # ones too (with their error type as outcome, and no tokens).
        assert wait_for(lambda: len(ledger(tmp_path, key_id)) == fired, 5)  # noqa: B023
        rows = ledger(tmp_path, key_id)
        assert sum(row["outcome"] == "ok" for row in rows) == answered
        assert {row["outcome"] for row in rows} == {"ok", "insufficient_quota"}
        used = sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows)
        assert 0 < used <= QUOTA
        remaining = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert remaining.headers["x-ratelimit-limit-tokens"] == str(QUOTA)
        assert remaining.headers["x-ratelimit-remaining-tokens"] == str(
            QUOTA - used
        )  # the headers agree with the ledger
        assert remaining.headers["x-ratelimit-reset-tokens"].endswith("s")
        if round_ == 1:
            server.stop()
            server = start_server(CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})  # the counters are in SQLite
    summary = json.loads(cli(tmp_path, "keys", "usage", key_id).stdout)
    assert summary["total_tokens"] == used and summary["requests"] == len(rows)
    over_http = httpx.get(server.url + "/api/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert over_http["total_tokens"] == used
    other = make_key(tmp_path, "nosy")
    assert (
        httpx.get(
            server.url + "/api/usage", params={"key": key_id}, headers={"Authorization": f"Bearer {other}"}
        ).status_code
        == 403
    )
    assert (
        httpx.get(
            server.url + "/api/usage", params={"key": key_id}, headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()["total_tokens"]
        == used
    )


def test_speed_average_metrics_and_disconnect_charging(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    server = start_server(CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})
    key = make_key(tmp_path, "speedy", quota_tokens=100000, quota_period="month")
    headers = {"Authorization": f"Bearer {key}"}

    def listed() -> dict[str, Any]:
        return dict(httpx.get(server.url + "/v1/models", headers=headers).json()["data"][0])

    assert "avg_tokens_per_second" not in listed()
    bad = httpx.post(server.url + "/api/generate", json={"prompt": "apple " * 1500, "max_tokens": 4}, headers=headers)
    assert bad.status_code == 400
    assert "avg_tokens_per_second" not in listed()  # failed requests do not count
    speeds = []
    for _ in range(3):
        answer = httpx.post(
            server.url + "/api/generate",
            json={"prompt": "Count to twenty.", "max_tokens": 40, "temperature": 0},
            headers=headers,
            timeout=60,
        ).json()
        speeds.append(answer["tokens_per_second"])
    average = listed()["avg_tokens_per_second"]
    reported = sum(speeds) / len(speeds)
    assert abs(average - reported) <= 0.25 * reported, (average, speeds)

    # A stream the client leaves after a few tokens is charged for its prompt and what was generated.
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        events = (line for line in response.iter_lines() if line)
        for _ in range(8):  # the role chunk, then 7 tokens
            next(events)
    key_id = key_id_of(tmp_path, "speedy")
    assert wait_for(lambda: any(r["outcome"] == "client_closed" for r in ledger(tmp_path, key_id)), 10)
    (left,) = [r for r in ledger(tmp_path, key_id) if r["outcome"] == "client_closed"]
    assert left["prompt_tokens"] > 20 and 5 <= left["completion_tokens"] < 300

    # /metrics parses, is for admins only, and its counters match the ledger.
    assert httpx.get(server.url + "/metrics", headers=headers).status_code == 403
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rows = ledger(tmp_path)
    completion = sum(s.value for s in families["llmserver_completion_tokens"].samples if s.name.endswith("_total"))
    assert completion == sum(r["completion_tokens"] for r in rows)
    requests = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["llmserver_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests[("/api/generate", "ok")] == 3 and requests[("/api/generate", "context_length_exceeded")] == 1
    assert requests[("/v1/chat/completions", "client_closed")] == 1
    assert any(
        s.value > 0 for s in families["llmserver_time_to_first_token_seconds"].samples if s.name.endswith("_count")
    )
    gaps = families["llmserver_inter_token_seconds"].samples
    assert any(s.value > 0 for s in gaps if s.name.endswith("_count"))
    buckets = [s.value for s in gaps if s.name.endswith("_bucket")]  # cumulative, +Inf last: every gap
    assert buckets == sorted(buckets) and buckets[-1] == next(s.value for s in gaps if s.name.endswith("_count"))
    assert [s.labels["le"] for s in gaps if s.name.endswith("_bucket")][-2:] == ["1.28", "+Inf"]
    assert next(s.value for s in gaps if s.name.endswith("_sum")) > 0
    ready = [s for s in families["llmserver_instances"].samples if s.labels["status"] == "ready"]
    assert ready[0].value == 1


def test_key_admin_api(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    server = start_server(CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN})
    admin = {"Authorization": f"Bearer {ADMIN}"}
    created = httpx.post(
        server.url + "/api/keys",
        json={"name": "ci", "quota_tokens": 500, "quota_period": "month", "rpm": 2},
        headers=admin,
    )
    assert created.status_code == 201, created.text
    record = created.json()
    key, key_id = record.pop("key"), record["id"]
    assert record["quota_tokens"] == 500 and record["rpm"] == 2 and record["admin"] is False
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(server.url + "/api/keys", headers=headers).status_code == 403
    assert [k["id"] for k in httpx.get(server.url + "/api/keys", headers=admin).json()["data"]] == [key_id]
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(server.url + "/api/generate", json=body, headers=headers, timeout=60).status_code == 200
    assert httpx.post(server.url + "/api/generate", json=body, headers=headers, timeout=60).status_code == 200
    limited = httpx.post(server.url + "/api/generate", json=body, headers=headers)
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(limited.headers["Retry-After"]) <= 61
    bad = httpx.patch(server.url + f"/api/keys/{key_id}", json={"quota_period": None}, headers=admin)
    assert bad.status_code == 400 and "period" in bad.json()["error"]["message"]
    updated = httpx.patch(
        server.url + f"/api/keys/{key_id}",
        json={"quota_tokens": 10, "quota_period": "total", "rpm": None},
        headers=admin,
    )
    assert updated.status_code == 200 and updated.json()["rpm"] is None
    # a PATCH leaves what it does not name
    narrowed = httpx.patch(server.url + f"/api/keys/{key_id}", json={"models": ["SmolLM2*"]}, headers=admin).json()
    assert narrowed["models"] == ["SmolLM2*"] and narrowed["quota_tokens"] == 10 and narrowed["quota_period"] == "total"
    over = httpx.post(server.url + "/api/generate", json={"prompt": "hi", "max_tokens": 50}, headers=headers)
    assert over.status_code == 429 and over.json()["error"]["type"] == "insufficient_quota"
    assert "does not reset" in over.json()["error"]["message"]
    revoked = httpx.delete(server.url + f"/api/keys/{key_id}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.delete(server.url + f"/api/keys/{key_id}", headers=admin).status_code == 404
