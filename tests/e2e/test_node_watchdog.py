"""The watchdog on a worker host, against a real hang: a gateway of role `gateway` sends the pattern that
holds llama-server's main loop (its /health still answering) to the instance an `llmserver node` runs.
The node sees no request of its own, yet it probes its instances' /slots (an instance it has not heard
answer is probed like an idle one) and restarts the one that makes no progress, having first noted in
Redis which process and why: the gateway fails the request with that reason (504, as on one host) long
before its request_timeout and does not send it again to hang the restarted instance, and the model serves
again (issue 58: "a stuck one there ended only by request_timeout")."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import (
    MODEL,
    Server,
    assert_error,
    create_key,
    free_port,
    free_port_range,
    shared_servers,
    spawn,
    wait_for,
)

pytestmark = pytest.mark.slow

SECRET = "node-watchdog-instance-key-0123456789"
ADMIN = "node-watchdog-admin-key-0123456789ab"
METRICS_TOKEN = "node-watchdog-metrics-token-0123456"
MODELS = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = 1
min_instances = 1
max_instances = 1
"""
HANGS = "^((a{0,99}){0,99}){0,99}$"


@dataclass
class Host:
    gateway: Server
    node_log: Path
    node_port: int

    def node_stalls(self) -> float:
        """The node's own count of instances its watchdog restarted (its /metrics)."""
        text = httpx.get(f"http://127.0.0.1:{self.node_port}/metrics",
                         headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text  # fmt: skip
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "llmserver_instance_stalls_total" and sample.labels.get("model") == MODEL:
                    return float(sample.value)
        return 0.0

    def instances(self) -> list[dict[str, object]]:
        listed = httpx.get(self.gateway.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"})
        return [i for i in listed.json()["data"] if i["status"] in ("ready", "busy")]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root = tmp_path_factory.mktemp("node-watchdog")
    _, redis_server = shared_servers()
    redis_server.flush()
    data = root / "node"
    data.mkdir()
    (data / "config.toml").write_text(MODELS)
    node_port = free_port()
    env = {**os.environ, "LLMSERVER_NODE__ID": "watched", "LLMSERVER_NODE__PORT": str(node_port),
           "LLMSERVER_OBSERVABILITY__METRICS_TOKEN": METRICS_TOKEN,
           "LLMSERVER_INSTANCES__API_KEY": SECRET, "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4)),
           "LLMSERVER_INSTANCES__STALL_TIMEOUT": "3", "LLMSERVER_INSTANCES__HEALTH_INTERVAL": "0.5"}  # fmt: skip
    node = spawn(
        [sys.executable, "-m", "llmserver", "node", "--config", str(data / "config.toml"), "--data-dir", str(data),
         "--redis-url", redis_server.url],
        root / "node.log", env,
    )  # fmt: skip
    # The pattern check opened up (as test_watchdog.py does on one host): the hang is what is tested.
    gateway = Server(
        data_dir=root / "gateway", config="limits.max_pattern_cost = 1000000000000\n" + MODELS,
        env={"LLMSERVER_ROLE": "gateway", "LLMSERVER_STATE__REDIS_URL": redis_server.url, "LLMSERVER_ADMIN_KEY": ADMIN},
        instance_key=SECRET,
    )  # fmt: skip
    try:
        running = Host(gateway.start(), root / "node.log", node_port)
        assert wait_for(lambda: len(running.instances()) == 1, 120), running.node_log.read_text()
        yield running
    finally:
        gateway.stop()
        node.terminate()
        node.wait(30)


def test_a_node_restarts_its_instance_that_makes_no_progress_on_a_gateways_request(host: Host) -> None:
    key = create_key(host.gateway.data_dir, "hanging")
    headers = {"Authorization": f"Bearer {key}"}
    (before,) = host.instances()
    body = {
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": HANGS}}},
    }
    sent = time.monotonic()
    answer = httpx.post(host.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    took = time.monotonic() - sent
    error = assert_error(answer, 504, "timeout_error")
    assert "made no progress for 3 s on node watched" in str(error["message"]), error
    assert took < 60, took  # the gateway's request_timeout is 600 s
    assert host.node_stalls() == 1  # restarted once: the request was not sent again to hang the new process
    # The node restarted it: the same instance, a new process, serving again.
    assert wait_for(lambda: [i["pid"] for i in host.instances()] not in ([], [before["pid"]]), 60)
    (after,) = host.instances()
    assert after["instance_id"] == before["instance_id"]
    again = httpx.post(host.gateway.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2}, headers=headers,
                       timeout=120)  # fmt: skip
    assert again.status_code == 200, again.text
    print(f"\nthe hung request failed after {took:.1f} s: {error['message']}")


def test_on_a_worker_host_the_stall_is_held_against_the_grammar_s_key_and_another_key_is_answered(
    host: Host,
) -> None:
    """Issue 82: the node learns which keys' requests carry a grammar from the gateways' loads; its stall note
    names them, so the gateway fails the culprit's request with 504 and sends another key's again."""
    culprit, victim = create_key(host.gateway.data_dir, "node-culprit"), create_key(host.gateway.data_dir, "victim")
    assert wait_for(lambda: len(host.instances()) == 1, 60)
    stalls = host.node_stalls()
    body = {
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": HANGS}}},
    }
    outcome: list[httpx.Response] = []

    def hang() -> None:
        outcome.append(httpx.post(host.gateway.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {culprit}"}, timeout=120))  # fmt: skip

    holder = threading.Thread(target=hang)
    holder.start()
    assert wait_for(lambda: any(int(i["active_users"]) for i in host.instances()), 30)
    sent = time.monotonic()
    answer = httpx.post(host.gateway.url + "/api/generate", json={"prompt": "Hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {victim}"}, timeout=120)  # fmt: skip
    waited = time.monotonic() - sent
    holder.join(120)
    assert answer.status_code == 200, answer.text  # sent again to the restarted process
    assert outcome and outcome[0].status_code == 504, outcome
    assert host.node_stalls() == stalls + 1
    print(f"\nanother key's request behind the hang answered after {waited:.1f} s")
