"""Only the gateway can use its instances: each demands a key, random unless instance_api_key is set,
so a local process cannot call /completion past quotas and the ledger, or read /slots (issue 39, row 4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import MODEL, Server, create_key

CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 512
threads = 1
"""


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


@pytest.mark.slow
def test_a_servers_instances_refuse_everyone_else(tmp_path: Path, servers: list[Server]) -> None:
    server = Server(data_dir=tmp_path, config=CONFIG, instance_key="")  # no instance_api_key: a random one
    servers.append(server.start())
    admin = create_key(server.data_dir, "admin", admin=True)
    (record,) = httpx.get(server.url + "/api/instances", headers={"Authorization": f"Bearer {admin}"}).json()["data"]
    instance = f"http://127.0.0.1:{record['port']}"
    body = {"prompt": "Hello", "n_predict": 2}
    for method, path in [("POST", "/completion"), ("POST", "/v1/chat/completions"), ("GET", "/slots"),
                         ("GET", "/props"), ("POST", "/tokenize"), ("GET", "/metrics")]:  # fmt: skip
        answer = httpx.request(method, instance + path, json=body if method == "POST" else None, timeout=30)
        assert answer.status_code == 401, (path, answer.status_code, answer.text)
    guessed = httpx.post(instance + "/completion", json=body, headers={"Authorization": "Bearer guess"}, timeout=30)
    assert guessed.status_code == 401
    # /health says only that it is alive; the gateway, which holds the key, serves as before.
    assert httpx.get(instance + "/health").status_code == 200
    key = create_key(server.data_dir, "user")
    reply = httpx.post(server.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip
    assert reply.status_code == 200, reply.text


def test_the_configured_instance_key_is_the_one_demanded(server: Server) -> None:
    """With instance_api_key set (as the test servers do), that key and only it opens the instance."""
    assert httpx.get(server.instance_url + "/slots").status_code == 401
    assert httpx.get(server.instance_url + "/slots", headers=server.instance_headers).status_code == 200
