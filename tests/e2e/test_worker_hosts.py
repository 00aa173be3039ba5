"""Worker hosts on one machine: network namespaces joined by a bridge, a real `llmserver node` in each
(the embedded model, its instances bound to the namespace's address with an API key), Redis on the
bridge, and a gateway of role `gateway` that routes to whatever the nodes publish. A node killed with
-9 or cut off (`ip link set … down`) leaves the registry within its 3-second lease; back, it rejoins."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.services import Postgres, Redis
from tests.support import MODEL, Server, cli, die_with_parent, metric, wait_for

BRIDGE = "llms-br0"
NET = "10.79.0"
SECRET = "instance-secret-0123456789abcdef"
ADMIN = "worker-hosts-admin-key-0123456789"
CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = 1
max_instances = 2
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Node:
    index: int
    root: Path
    redis_url: str
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def namespace(self) -> str:
        return f"llms-w{self.index}"

    @property
    def address(self) -> str:
        return f"{NET}.{10 + self.index}"

    @property
    def log(self) -> Path:
        return self.root / f"node{self.index}-{self.starts}.log"

    def start(self) -> Node:
        self.starts += 1
        data = self.root / f"node{self.index}"
        data.mkdir(exist_ok=True)
        (data / "config.toml").write_text(CONFIG)
        env = {**os.environ, "LLMSERVER_INSTANCE_API_KEY": SECRET, "LLMSERVER_INSTANCE_BASE_PORT": "8101",
               "LLMSERVER_NODE_ID": f"worker-{self.index}"}  # fmt: skip
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, sys.executable, "-m", "llmserver", "node",
                 "--config", str(data / "config.toml"), "--data-dir", str(data), "--advertise", self.address,
                 "--redis-url", self.redis_url],
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent,
            )  # fmt: skip
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Hosts:
    root: Path
    redis: Redis
    nodes: list[Node] = field(default_factory=list)
    gateways: list[Server] = field(default_factory=list)
    gateway: Server | None = None
    database_url: str = ""

    def key(self, name: str) -> str:
        """A key in the gateways' shared database."""
        result = cli(self.root, "keys", "create", "--name", name, env={"LLMSERVER_DATABASE_URL": self.database_url})
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def instances(self) -> list[dict[str, Any]]:
        assert self.gateway is not None
        answer = httpx.get(self.gateway.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 200, answer.text
        return list(answer.json()["data"] if isinstance(answer.json(), dict) else answer.json())

    def hosts_seen(self) -> set[str]:
        return {i["host"] for i in self.instances()}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres) -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.fail("the worker-host tests make network namespaces: they run as root (CI does)")
    root = tmp_path_factory.mktemp("hosts")
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)  # left by a killed run
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    redis = None
    running = None
    try:
        for index in (1, 2):
            namespace = f"llms-w{index}"
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
            ip("netns", "add", namespace)
            ip("link", "add", f"llms-h{index}", "type", "veth", "peer", "name", f"llms-n{index}")
            ip("link", "set", f"llms-n{index}", "netns", namespace)
            ip("link", "set", f"llms-h{index}", "master", BRIDGE)
            ip("link", "set", f"llms-h{index}", "up")
            ip("netns", "exec", namespace, "ip", "addr", "add", f"{NET}.{10 + index}/24", "dev", f"llms-n{index}")
            ip("netns", "exec", namespace, "ip", "link", "set", f"llms-n{index}", "up")
            ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        redis = Redis(bind=f"{NET}.1 127.0.0.1").start()
        running = Hosts(root, redis)
        running.nodes = [Node(index, root, redis.url).start() for index in (1, 2)]
        running.database_url = postgres.new_database()
        migrated = cli(root, "db", "migrate", env={"LLMSERVER_DATABASE_URL": running.database_url})
        assert migrated.returncode == 0, migrated.stderr
        gateway_env = {
            "LLMSERVER_ROLE": "gateway", "LLMSERVER_REDIS_URL": redis.url, "LLMSERVER_INSTANCE_API_KEY": SECRET,
            "LLMSERVER_ADMIN_KEY": ADMIN, "LLMSERVER_DATABASE_URL": running.database_url,
        }  # fmt: skip
        for name in ("gw-1", "gw-2"):
            env = {**gateway_env, "LLMSERVER_GATEWAY_ID": name}
            running.gateways.append(Server(data_dir=root / name, config=CONFIG, env=env).start())
        running.gateway = running.gateways[0]
        assert wait_for(lambda: len(running.hosts_seen()) == 2, 120), running.instances()  # type: ignore[union-attr]
        yield running
    finally:
        if running is not None:
            for gateway in running.gateways:
                gateway.stop()
            for node in running.nodes:
                node.stop()
        if redis is not None:
            redis.stop()
        for index in (1, 2):
            subprocess.run(["ip", "netns", "del", f"llms-w{index}"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


def generate(server: Server, key: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def load(hosts: Hosts, key: str, count: int) -> list[httpx.Response]:
    """`count` tiny requests, 4 at a time, alternating between the two gateways."""
    gateways = hosts.gateways
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda i: generate(gateways[i % 2], key, f"Say the number {i}."), range(count)))


def test_both_worker_hosts_serve_through_both_gateways(hosts: Hosts) -> None:
    assert hosts.gateway is not None
    key = hosts.key("spread")
    answers = load(hosts, key, 16)
    assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers if r.status_code != 200]
    by_instance = {i["instance_id"]: i for i in hosts.instances()}
    served_hosts = {by_instance[r.json()["instance_id"]]["host"] for r in answers}
    assert served_hosts == {f"{NET}.11", f"{NET}.12"}
    for gateway in hosts.gateways:  # each gateway lists every host's instances
        listed = httpx.get(gateway.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert {i["instance_id"] for i in listed["data"]} == set(by_instance)
    for record in by_instance.values():
        assert record["pid"] > 0 and record["port"] == 8101 and record["ram_used_mb"] > 0
        assert record["node"] in ("worker-1", "worker-2") and record["status"] in ("ready", "busy")


def test_instances_on_a_worker_refuse_requests_without_the_key(hosts: Hosts) -> None:
    body = {"prompt": "hi", "n_predict": 1}
    refused = httpx.post(f"http://{NET}.11:8101/completion", json=body, timeout=10)
    assert refused.status_code == 401
    allowed = httpx.post(
        f"http://{NET}.11:8101/completion", json=body, headers={"Authorization": f"Bearer {SECRET}"}, timeout=30
    )
    assert allowed.status_code == 200


def test_a_killed_node_leaves_within_its_lease_and_rejoins_as_a_new_incarnation(hosts: Hosts) -> None:
    assert hosts.gateway is not None
    key = hosts.key("survivor")
    first = hosts.nodes[0]
    before = {i["instance_id"] for i in hosts.instances() if i["host"] == first.address}
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        during = background.submit(load, hosts, key, 24)
        time.sleep(0.5)
        first.kill()
        killed_at = time.monotonic()
        assert wait_for(lambda: first.address not in hosts.hosts_seen(), 6)
        left_after = time.monotonic() - killed_at
        answers = during.result(timeout=120)
    assert left_after <= 3.6, left_after
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 502} and statuses.count(200) >= len(statuses) - 2, statuses  # nothing hangs
    assert [r.status_code for r in load(hosts, key, 6)] == [200] * 6  # the other worker serves all
    first.start()
    assert wait_for(lambda: first.address in hosts.hosts_seen(), 120)
    after = {i["instance_id"] for i in hosts.instances() if i["host"] == first.address}
    assert after and not after & before  # a new incarnation, new instances
    print(f"killed node left the registry {left_after:.1f} s after kill -9")


def test_a_partitioned_node_is_evicted_and_rejoins_when_healed(hosts: Hosts) -> None:
    assert hosts.gateway is not None
    key = hosts.key("partition")
    second = hosts.nodes[1]
    ip("link", "set", "llms-h2", "down")
    try:
        cut_at = time.monotonic()
        assert wait_for(lambda: second.address not in hosts.hosts_seen(), 6)
        evicted_after = time.monotonic() - cut_at
        assert [r.status_code for r in load(hosts, key, 6)] == [200] * 6
    finally:
        ip("link", "set", "llms-h2", "up")
    healed_at = time.monotonic()
    assert wait_for(lambda: second.address in hosts.hosts_seen(), 15)
    print(
        f"partitioned node evicted after {evicted_after:.1f} s; back {time.monotonic() - healed_at:.1f} s after healing"
    )
    assert evicted_after <= 3.6


def test_after_a_redis_restart_the_nodes_publish_again_and_nothing_is_dropped(hosts: Hosts) -> None:
    import redis

    key = hosts.key("redis-restart")
    hosts.redis.stop()
    time.sleep(1.0)
    during = load(hosts, key, 8)  # the gateways route to the instances they know
    hosts.redis.start()  # empty
    back_at = time.monotonic()
    client = redis.Redis.from_url(hosts.redis.url)
    try:
        assert wait_for(lambda: len(client.keys("llmserver:instance:*")) == 2, 3)
        republished = time.monotonic() - back_at
    finally:
        client.close()
    assert [r.status_code for r in during] == [200] * 8
    assert len(hosts.hosts_seen()) == 2 and [r.status_code for r in load(hosts, key, 8)] == [200] * 8
    assert republished <= 2.0
    print(f"nodes republished {republished:.1f} s after Redis came back empty")


def test_an_admin_starts_and_drains_an_instance_on_a_chosen_node_through_a_gateway(hosts: Hosts) -> None:
    first, second = hosts.gateways
    headers = {"Authorization": f"Bearer {ADMIN}"}
    started = httpx.post(
        first.url + "/api/instances", json={"model": MODEL, "node": "worker-2"}, headers=headers, timeout=120
    )
    assert started.status_code == 201, started.text
    record = started.json()
    assert record["node"] == "worker-2" and record["host"] == f"{NET}.12" and record["status"] == "ready"

    # The other gateway routes to it too, within a registry read.
    def listed_by_second() -> set[str]:
        answer = httpx.get(second.url + "/api/instances", headers=headers).json()
        return {i["instance_id"] for i in answer["data"]}

    assert wait_for(lambda: record["instance_id"] in listed_by_second(), 3)
    unknown = httpx.post(first.url + "/api/instances", json={"model": MODEL, "node": "nowhere"}, headers=headers)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "node"
    drained = httpx.delete(second.url + f"/api/instances/{record['instance_id']}", headers=headers, timeout=120)
    assert drained.status_code == 200, drained.text
    assert wait_for(lambda: record["instance_id"] not in {i["instance_id"] for i in hosts.instances()}, 5)
    assert record["instance_id"] not in listed_by_second()
    assert len(hosts.hosts_seen()) == 2  # the nodes' own instances still serve


def test_a_conversation_stays_on_one_worker_whichever_gateway_takes_each_turn(hosts: Hosts) -> None:
    key = hosts.key("conversation")
    headers = {"Authorization": f"Bearer {key}"}

    def cached() -> float:
        return sum(metric(g, ADMIN, "llmserver_cached_prompt_tokens_total", model=MODEL) for g in hosts.gateways)

    before = cached()
    history = "You are a terse assistant. We are listing fruits, one per turn."
    served: list[str] = []
    for turn in range(6):
        gateway = hosts.gateways[turn % 2]  # the turns alternate between the gateways
        body = {"prompt": history + f"\nTurn {turn}: name a fruit.", "max_tokens": 4, "temperature": 0}
        session = {**headers, "X-Session-Id": "fruit-talk"}
        answer = httpx.post(gateway.url + "/api/generate", json=body, headers=session, timeout=60)
        assert answer.status_code == 200, answer.text
        served.append(answer.json()["instance_id"])
        history += f"\nTurn {turn}: name a fruit.\n{answer.json()['response']}"
    assert len(set(served)) == 1, served  # rendezvous hashing ranks the hosts alike on every gateway
    assert cached() - before > 0  # later turns reused the prompt the worker had cached
