"""Prices and spend against the real server: a model with prices makes each ledger row record its cost
at those prices (prompt read, prompt from the cache, completion), and /api/usage and the request log
report it in the server's currency; a model without prices records none."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import MODEL, Server, make_key

ADMIN = "spend-admin-key-0123456789abcdef"
PRICES = {"input": 2.5, "cached_input": 0.5, "output": 10.0}
CONFIG = f"""
[billing]
currency = "EUR"

[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 1024
prices = {{ input = 2.5, cached_input = 0.5, output = 10.0 }}
"""


@pytest.fixture(scope="module")
def priced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("spend"), CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN}).start()
    try:
        yield server
    finally:
        server.stop()


def expected(usage: dict[str, Any]) -> float:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    read = usage["prompt_tokens"] - cached
    return (
        read * PRICES["input"] + cached * PRICES["cached_input"] + usage["completion_tokens"] * PRICES["output"]
    ) / 1e6


def test_each_request_costs_its_tokens_at_its_model_s_prices_and_usage_reports_the_spend(priced: Server) -> None:
    key = make_key(priced.data_dir, "spender")
    headers = {"Authorization": f"Bearer {key}"}
    prompt = "Tell me about the sea. " * 12
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}
    usages = []
    for _ in range(2):  # the second one reads its prompt from the cache, mostly
        answer = httpx.post(priced.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        usages.append(answer.json()["usage"])
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # so the cached price is what is checked

    log = httpx.get(priced.url + "/api/usage/requests", headers=headers).json()["data"][::-1]
    assert [row["cost"] for row in log] == pytest.approx([expected(u) for u in usages], rel=1e-9)
    assert log[1]["cost"] < log[0]["cost"]  # cached tokens cost less

    summary = httpx.get(priced.url + "/api/usage", headers=headers).json()
    assert summary["currency"] == "EUR"
    assert summary["cost"] == pytest.approx(sum(expected(u) for u in usages), abs=1e-6)
    assert summary["by_model"][MODEL]["cost"] == summary["cost"]
    admin = httpx.get(priced.url + "/api/usage", params={"key": "*"}, headers={"Authorization": f"Bearer {ADMIN}"})
    by_key = admin.json()["by_key"]
    assert [k["cost"] for k in by_key.values()] == [summary["cost"]]
    points = httpx.get(priced.url + "/api/usage/series", params={"bucket": "hour"}, headers=headers).json()["points"]
    assert sum(p["cost"] for p in points) == pytest.approx(summary["cost"], abs=1e-6)  # the chart's spend


def test_a_model_without_prices_records_no_cost_until_the_catalog_gives_it_prices(priced: Server) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    unpriced = {"name": "unpriced", "min_instances": 1, "max_instances": 1, "ctx_size": 512, "parallel": 1}
    assert httpx.post(priced.url + "/api/models", json=unpriced, headers=admin).status_code == 201
    try:
        key = make_key(priced.data_dir, "free-rider")
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": "unpriced", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
        assert (
            httpx.post(priced.url + "/v1/chat/completions", json=body, headers=headers, timeout=90).status_code == 200
        )
        rows = httpx.get(priced.url + "/api/usage/requests", headers=headers).json()["data"]
        assert [(r["model"], r["cost"]) for r in rows] == [("unpriced", None)]
        summary = httpx.get(priced.url + "/api/usage", headers=headers).json()
        assert summary["cost"] is None and "cost" not in summary["by_model"]["unpriced"]
        # Prices are a live setting: given through the catalog, the next request is costed, no restart.
        priced_now = httpx.patch(priced.url + "/api/models/unpriced", json={"prices": {"input": 1, "output": 1}},
                                 headers=admin)  # fmt: skip
        assert priced_now.status_code == 200, priced_now.text
        answer = httpx.post(priced.url + "/v1/chat/completions", json=body, headers=headers, timeout=90)
        usage = answer.json()["usage"]
        newest = httpx.get(priced.url + "/api/usage/requests", headers=headers).json()["data"][0]
        assert newest["cost"] == pytest.approx((usage["prompt_tokens"] + usage["completion_tokens"]) / 1e6)
        bad = httpx.patch(priced.url + "/api/models/unpriced", json={"prices": {"input": -1, "output": 1}},
                          headers=admin)  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("prices"), bad.text
    finally:
        httpx.delete(priced.url + "/api/models/unpriced", headers=admin)
