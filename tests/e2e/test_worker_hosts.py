"""Worker hosts on one machine: network namespaces joined by a bridge, a real `llmserver node` in each
(the embedded model, its instances bound to the namespace's address with an API key, over HTTPS with a
certificate of a private CA that the gateways verify), Redis on the bridge, and a gateway of role
`gateway` that routes to whatever the nodes publish. A node killed with -9 or cut off
(`ip link set … down`) leaves the registry within its 3-second lease; back, it rejoins."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import (
    COUNTING,
    MODEL,
    Server,
    cli,
    launched_chromium,
    metric,
    spawn,
    tls_certificates,
    wait_for,
)
from tests.support.hosts import NodeProcess, add_host, ip
from tests.support.services import Postgres, Redis

# Four hosts, nodes killed and restarted, about 90 s: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

BRIDGE = "llms-br0"
NET = "10.79.0"
SECRET = "instance-secret-0123456789abcdef"
ADMIN = "worker-hosts-admin-key-0123456789"
METRICS_TOKEN = "worker-hosts-metrics-token-0123"
# One tenant here, and the prompt cache of nodes' instances shared (the default "key" across gateways:
# tests/e2e/test_shared_slots.py).
CONFIG = f"""
prompt_cache.isolation = "shared"
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = 1
max_instances = 2
max_queue = 4
instance_queue = 0  # what these tests count: the slots and the gateways' one queue
"""


class Node(NodeProcess):
    """A worker host's node: its own [[models]], its instances on HTTPS with the instance key."""

    @property
    def namespace(self) -> str:
        return f"llms-w{self.index}"

    @property
    def address(self) -> str:
        return f"{NET}.{10 + self.index}"

    def start(self) -> Node:
        self.starts += 1
        data = self.root / f"node{self.index}"
        data.mkdir(exist_ok=True)
        (data / "config.toml").write_text(CONFIG)
        _, cert, key = tls_files(self.root)
        env = {**os.environ, "LLMSERVER_INSTANCES__API_KEY": SECRET, "LLMSERVER_INSTANCES__BASE_PORT": "8101",
               "LLMSERVER_NODE__ID": f"worker-{self.index}", "LLMSERVER_INSTANCES__TLS_CERT": str(cert),
               "LLMSERVER_INSTANCES__TLS_KEY": str(key), "LLMSERVER_NODE__HOST": self.address,
               "LLMSERVER_OBSERVABILITY__METRICS_TOKEN": METRICS_TOKEN}  # fmt: skip
        self.process = spawn(
            ["ip", "netns", "exec", self.namespace, sys.executable, "-m", "llmserver", "node",
             "--config", str(data / "config.toml"), "--data-dir", str(data), "--advertise", self.address,
             "--redis-url", self.redis_url],
            self.log, env,
        )  # fmt: skip
        return self


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
        result = cli(
            self.root, "keys", "create", "--name", name, env={"LLMSERVER_STATE__DATABASE_URL": self.database_url}
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def instances(self, gateway: Server | None = None) -> list[dict[str, Any]]:
        asked = gateway or self.gateway
        assert asked is not None
        answer = httpx.get(asked.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 200, answer.text
        return list(answer.json()["data"] if isinstance(answer.json(), dict) else answer.json())

    def hosts_seen(self, gateway: Server | None = None) -> set[str]:
        return {i["host"] for i in self.instances(gateway)}

    def gateway_env(self, routing: str = "affinity") -> dict[str, str]:
        return {
            "LLMSERVER_ROLE": "gateway", "LLMSERVER_STATE__REDIS_URL": self.redis.url,
            "LLMSERVER_INSTANCES__API_KEY": SECRET,
            "LLMSERVER_ADMIN_KEY": ADMIN, "LLMSERVER_STATE__DATABASE_URL": self.database_url,
            "LLMSERVER_ROUTER__POLICY": routing,
            "LLMSERVER_INSTANCES__TLS_CA": str(tls_files(self.root)[0]),
            "LLMSERVER_OBSERVABILITY__METRICS_TOKEN": METRICS_TOKEN,
        }  # fmt: skip

    def start_gateways(self, routing: str) -> None:
        env = self.gateway_env(routing)
        for number, (index, namespace) in enumerate(GATEWAYS.items(), 1):
            gateway = Server(
                data_dir=self.root / f"gw-{number}", config=CONFIG,
                env={**env, "LLMSERVER_STATE__GATEWAY_ID": f"gw-{number}"}, host=f"{NET}.{10 + index}",
                namespace=namespace,
            )  # fmt: skip
            self.gateways.append(gateway.start())
        self.gateway = self.gateways[0]

    def stop_gateways(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        self.gateways = []
        self.gateway = None

    def usage(self, key: str) -> dict[str, Any]:
        assert self.gateway is not None
        answer = httpx.get(self.gateway.url + "/api/usage", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


def tls_files(root: Path) -> tuple[Path, Path, Path]:
    """The test CA, and the one certificate (with its key) every worker's instances serve HTTPS with."""
    folder = root / "tls"
    if not (folder / "key.pem").exists():
        tls_certificates(folder, [f"{NET}.{10 + index}" for index in [*WORKERS, GUIDE_HOST]])
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    return paths


WORKERS = {1: "llms-w1", 2: "llms-w2"}  # NET.11, NET.12
GUIDE_HOST = 3  # NET.13: the worker host of the Worker hosts guide, run as written
GATEWAYS = {11: "llms-g1", 12: "llms-g2"}  # NET.21, NET.22


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Two worker hosts and two gateway hosts, each a namespace; PostgreSQL and Redis on a fifth
    (the root namespace, on the bridge's address)."""
    if os.geteuid() != 0:
        pytest.fail("the worker-host tests make network namespaces: they run as root (CI does)")
    root = tmp_path_factory.mktemp("hosts")
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)  # left by a killed run
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    redis = postgres = running = None
    try:
        for index, namespace in {**WORKERS, **GATEWAYS}.items():
            add_host(index, namespace, BRIDGE, NET)
        redis = Redis(bind=f"{NET}.1 127.0.0.1").start()
        postgres = Postgres(listen=f"{NET}.1,127.0.0.1", trust=f"{NET}.0/24").start()
        running = Hosts(root, redis)
        running.nodes = [Node(index, root, redis.url).start() for index in WORKERS]
        running.database_url = postgres.new_database()
        migrated = cli(root, "db", "migrate", env={"LLMSERVER_STATE__DATABASE_URL": running.database_url})
        assert migrated.returncode == 0, migrated.stderr
        running.start_gateways("affinity")
        assert wait_for(lambda: len(running.hosts_seen()) == 2, 120), running.instances()  # type: ignore[union-attr]
        yield running
    finally:
        if running is not None:
            running.stop_gateways()
            for node in running.nodes:
                node.stop()
        for service in (redis, postgres):
            if service is not None:
                service.stop()
        for namespace in {**WORKERS, **GATEWAYS}.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


def generate(server: Server, key: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def load(hosts: Hosts, key: str, count: int, at_once: int = 4) -> list[httpx.Response]:
    """`count` tiny requests, `at_once` at a time, alternating between the two gateways."""
    gateways = hosts.gateways
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda i: generate(gateways[i % 2], key, f"Say the number {i}."), range(count)))


def opened_stream(server: Server, key: str, prompt: str) -> tuple[int, list[str]]:
    """A streamed completion: its status, and its event lines (a stream cut after its first event ends
    with an error event; one refused before it has a status other than 200)."""
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as answer:  # fmt: skip
        return answer.status_code, [line for line in answer.iter_lines() if line]


def streamed_load(hosts: Hosts, key: str, count: int, at_once: int = 4) -> list[tuple[int, list[str]]]:
    """`count` streamed completions, `at_once` at a time, alternating between the two gateways."""
    gateways = hosts.gateways
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda i: opened_stream(gateways[i % 2], key, f"Count to {i}."), range(count)))


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


def test_instances_on_a_worker_take_only_tls_and_refuse_requests_without_the_key(hosts: Hosts) -> None:
    body = {"prompt": "hi", "n_predict": 1}
    ca = ssl.create_default_context(cafile=str(tls_files(hosts.root)[0]))
    with pytest.raises(httpx.TransportError):  # no plain HTTP: the key would cross the network in clear
        httpx.post(f"http://{NET}.11:8101/completion", json=body, headers={"Authorization": f"Bearer {SECRET}"})
    with pytest.raises(httpx.ConnectError):  # a certificate the system does not trust: refused
        httpx.post(f"https://{NET}.11:8101/completion", json=body, timeout=10)
    refused = httpx.post(f"https://{NET}.11:8101/completion", json=body, timeout=10, verify=ca)
    assert refused.status_code == 401
    allowed = httpx.post(
        f"https://{NET}.11:8101/completion", json=body, headers={"Authorization": f"Bearer {SECRET}"}, timeout=30,
        verify=ca,
    )  # fmt: skip
    assert allowed.status_code == 200


def test_a_killed_node_leaves_within_its_lease_and_rejoins_as_a_new_incarnation(hosts: Hosts) -> None:
    assert hosts.gateway is not None
    key = hosts.key("survivor")
    first = hosts.nodes[0]
    before = {i["instance_id"] for i in hosts.instances() if i["host"] == first.address}
    with concurrent.futures.ThreadPoolExecutor(2) as background:
        # 4 requests at a time in all, as before the streams were added: what one surviving node's slots
        # and the gateways' queue (max_queue 4) take without refusing any.
        during = background.submit(load, hosts, key, 24, 2)
        streams = background.submit(streamed_load, hosts, key, 24, 2)
        time.sleep(0.5)
        first.kill()
        killed_at = time.monotonic()
        assert wait_for(lambda: first.address not in hosts.hosts_seen(), 6)
        left_after = time.monotonic() - killed_at
        answers = during.result(timeout=120)
        streamed = streams.result(timeout=120)
    try:
        check_the_survivors(hosts, key, left_after, answers, streamed)
    finally:  # back for the tests after this one, whatever this one found
        first.start()
        assert wait_for(lambda: first.address in hosts.hosts_seen(), 120)
    after = {i["instance_id"] for i in hosts.instances() if i["host"] == first.address}
    assert after and not after & before  # a new incarnation, new instances


def check_the_survivors(
    hosts: Hosts, key: str, left_after: float, answers: list[httpx.Response], streamed: list[tuple[int, list[str]]]
) -> None:
    assert left_after <= 3.6, left_after
    statuses = [r.status_code for r in answers]
    assert statuses == [200] * len(statuses), [r.text for r in answers if r.status_code != 200]
    # The other node had ready instances the whole time: no stream fails before its first byte (a retry
    # goes to another node, and the killed node's other instance is not tried once one dropped).
    assert [status for status, _ in streamed] == [200] * len(streamed), [s for s, _ in streamed]
    assert all(lines[-1] == "data: [DONE]" for _, lines in streamed)
    cut = sum('"error"' in lines[-2] for _, lines in streamed)  # cut mid-way on the killed node: said so
    assert [r.status_code for r in load(hosts, key, 6)] == [200] * 6  # the other worker serves all
    print(f"killed node left the registry {left_after:.1f} s after kill -9; statuses under load {statuses}; "
          f"{len(streamed)} streams, 0 failed before their first byte, {cut} cut mid-way")  # fmt: skip


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


def test_the_consoles_models_page_shows_each_models_instances_on_every_worker(hosts: Hosts) -> None:
    assert hosts.gateway is not None
    # Its own browser, closed at the end: the module's later tests run asyncio loops of their own.
    with launched_chromium() as chromium:
        show_models_page(hosts, chromium)


def show_models_page(hosts: Hosts, chromium: Any) -> None:
    assert hosts.gateway is not None
    context = chromium.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        page.goto(hosts.gateway.url + "/console")
        page.fill("#api-key", ADMIN)
        page.click("#sign-in-form button[type=submit]")
        page.click("#tabs button[data-tab=models]")
        row = page.locator(f"#catalog-table tr[data-model='{MODEL}']")
        row.wait_for()

        def shown() -> set[str]:
            return {str(text).strip() for text in row.locator("li").all_text_contents()}

        def running() -> set[str]:
            return {f"{i['node']} {i['host']}:{i['port']} {i['status']}" for i in hosts.instances()}

        # Every instance on every worker, named by its node, host and port, with its state.
        assert wait_for(lambda: shown() == running(), 10), (shown(), running())
        assert {line.split()[0] for line in shown()} == {"worker-1", "worker-2"}
        assert row.locator("td").nth(2).text_content() == "api"  # a gateway's models live in the catalog
        page.screenshot(path=str(hosts.root / "models-cluster.png"), full_page=True)
        if os.environ.get("LLMSERVER_CONSOLE_SHOTS"):
            shutil.copy(hosts.root / "models-cluster.png", Path(os.environ["LLMSERVER_CONSOLE_SHOTS"]))
    finally:
        context.close()


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


def status_on(gateway: Server, host: str) -> str:
    """The status one gateway gives the instance on `host` (one instance per worker here)."""
    listed = httpx.get(gateway.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    return str(next(i["status"] for i in listed if i["host"] == host))


def test_a_gateway_cut_off_from_one_worker_opens_its_circuit_and_closes_it_when_healed(hosts: Hosts) -> None:
    key = hosts.key("circuit")
    first, second = hosts.gateways
    worker = hosts.nodes[1]
    # The first gateway's host loses its route to the second worker; the worker still reaches Redis,
    # so its instance stays in the registry: only this gateway's breaker can keep requests off it.
    ip("netns", "exec", GATEWAYS[11], "ip", "route", "add", "unreachable", f"{worker.address}/32")
    try:
        answers = [generate(first, key, f"Say the number {i}.") for i in range(16)]
        assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers if r.status_code != 200]
        by_instance = {i["instance_id"]: i["host"] for i in hosts.instances()}
        assert {by_instance[r.json()["instance_id"]] for r in answers} == {hosts.nodes[0].address}
        assert status_on(first, worker.address) == "failed"
        assert status_on(second, worker.address) in ("ready", "busy")  # the other gateway still reaches it
        through_second = [generate(second, key, f"Say the number {i}.") for i in range(8)]
        assert {by_instance[r.json()["instance_id"]] for r in through_second} == {f"{NET}.11", f"{NET}.12"}
    finally:
        ip("netns", "exec", GATEWAYS[11], "ip", "route", "del", "unreachable", f"{worker.address}/32")
    healed_at = time.monotonic()
    assert wait_for(lambda: status_on(first, worker.address) in ("ready", "busy"), 20)
    closed_after = time.monotonic() - healed_at
    served = {by_instance.get(r.json()["instance_id"]) for r in (generate(first, key, f"Hi {i}.") for i in range(8))}
    assert served == {f"{NET}.11", f"{NET}.12"}
    print(f"circuit closed {closed_after:.1f} s after the route came back")


def long_generation(server: Server, key: str, max_tokens: int = 400) -> httpx.Response:
    body = {"prompt": COUNTING, "raw": True, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_slots_and_the_queue_bound_hold_across_gateways(hosts: Hosts) -> None:
    key = hosts.key("shared-queue")
    first, second = hosts.gateways
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # Two requests through each gateway take the four slots, two per worker: the second gateway
        # sees the first one's requests on the instances (a registry read later) and takes the others.
        running = [pool.submit(long_generation, first, key) for _ in range(2)]
        time.sleep(1.2)
        running += [pool.submit(long_generation, second, key) for _ in range(2)]
        time.sleep(1.2)
        waiting = [pool.submit(long_generation, first, key, 8) for _ in range(4)]  # max_queue is 4 in all
        time.sleep(1.2)
        refused = long_generation(second, key, 8)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert "4 requests are already waiting" in refused.json()["error"]["message"]
        answers = [f.result(timeout=120) for f in running + waiting]
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
    per_instance = collections.Counter(r.json()["instance_id"] for r in answers[:4])
    assert sorted(per_instance.values()) == [2, 2], per_instance  # never three on one instance's two slots


def stream_completion(server: Server, key: str, started: threading.Semaphore) -> list[str]:
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True}
    lines: list[str] = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line:
                lines.append(line)
                if len(lines) == 20:
                    started.release()
    return lines


def test_streams_on_a_killed_node_end_with_an_error_event_and_are_charged_what_they_produced(hosts: Hosts) -> None:
    key = hosts.key("stream-kill")
    first = hosts.gateways[0]
    doomed = hosts.nodes[0]
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_completion, first, key, started) for _ in range(4)]  # the 4 slots, 2 per worker
        for _ in range(4):
            assert started.acquire(timeout=60)
        doomed.kill()
        results = [f.result(timeout=120) for f in streams]
    try:
        assert all(lines[-1] == "data: [DONE]" for lines in results), [lines[-3:] for lines in results]
        cut = [lines for lines in results if '"error"' in lines[-2]]
        assert len(cut) == 2, [lines[-2] for lines in results]  # the two on the killed worker
        for lines in cut:
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["type"] == "upstream_error"
        texts = [json.loads(line.removeprefix("data: "))["choices"] for lines in cut for line in lines[:-2]]
        streamed = sum(1 for choices in texts if choices and choices[0]["text"])  # one token per event
        usage = hosts.usage(key)
        assert usage["requests"] == 4 and usage["by_outcome"].get("ok") == 2
        assert usage["completion_tokens"] >= 2 * 400 + streamed, usage  # charged what the cut streams produced
    finally:
        doomed.start()
        assert wait_for(lambda: doomed.address in hosts.hosts_seen(), 120)


def test_prompt_cache_affinity_across_hosts_against_least_loaded(hosts: Hosts) -> None:
    """The affinity workload of the benchmark (bench/affinity.py) through both gateways, turn by turn
    alternating, routed each way; the figures are printed for the closing note and the README."""
    import asyncio

    from bench import affinity as workload

    addresses = sorted({f"{i['host']}:{i['port']}" for i in hosts.instances()})
    assert len(addresses) == 2, addresses
    later: dict[str, workload.Later] = {}
    try:
        for number, routing in enumerate(("least_loaded", "affinity")):
            hosts.stop_gateways()
            hosts.start_gateways(routing)
            # A gateway is ready once it knows every published instance: a gateway that knew only the
            # first to join would place the first turns on it and scatter conversations from their homes.
            assert all(len(hosts.hosts_seen(gateway)) == 2 for gateway in hosts.gateways)
            systems = workload.balanced_systems(MODEL, addresses, 4, first_seed=1000 * number)  # no cache shared
            headers = {"Authorization": f"Bearer {hosts.key('affinity-' + routing)}"}
            later[routing] = asyncio.run(workload.converse([g.url for g in hosts.gateways], headers, systems, 6))
    finally:
        if not hosts.gateways or "affinity" not in later:
            hosts.stop_gateways()
            hosts.start_gateways("affinity")
    for routing, turns in later.items():
        print(
            f"{routing}: turns 2-6 TTFT p50 {turns.median_ms:.0f} ms, mean {turns.mean_ms:.0f} ms, "
            f"{turns.cached_share:.1%} of prompt tokens from the cache"
        )
    affinity, least = later["affinity"], later["least_loaded"]
    print(f"affinity/least_loaded TTFT p50 ratio {affinity.median_ms / least.median_ms:.3f}")
    assert affinity.cached_share >= 0.9 and affinity.cached_share > least.cached_share, affinity.misses


def test_workers_serve_one_port_each_a_gateway_of_its_own(hosts: Hosts) -> None:
    """`serve --workers 2`: two processes on one port, each publishing its load as a gateway; a worker
    killed outright is started again while the other serves; SIGTERM stops them all, exit 0."""
    import psutil
    import redis

    env = {**hosts.gateway_env(), "LLMSERVER_STATE__GATEWAY_ID": "gw-multi", "LLMSERVER_SERVER__WORKERS": "2"}
    server = Server(data_dir=hosts.root / "gw-multi", config=CONFIG, env=env, host=f"{NET}.21", namespace="llms-g1")
    client = redis.Redis.from_url(hosts.redis.url)

    def gateways_publishing() -> set[str]:
        return {k.decode().removeprefix("llmserver:load:") for k in client.keys("llmserver:load:gw-multi-*")}

    try:
        server.start()
        assert server.process is not None
        supervisor = psutil.Process(server.process.pid)
        workers = supervisor.children()
        assert len(workers) == 2, workers
        key = hosts.key("workers")
        assert [generate(server, key, f"Say {i}.").status_code for i in range(8)] == [200] * 8
        assert wait_for(lambda: gateways_publishing() == {"gw-multi-1", "gw-multi-2"}, 5), gateways_publishing()
        workers[0].kill()
        # The other worker takes every new connection meanwhile: nothing is refused.
        assert [generate(server, key, f"Say {i}.").status_code for i in range(6)] == [200] * 6
        restarted = lambda: {c.pid for c in supervisor.children()} - {w.pid for w in workers}  # noqa: E731
        assert wait_for(lambda: len(restarted()) == 1, 30), supervisor.children()
        assert wait_for(lambda: len(gateways_publishing()) == 2, 30)
        assert "exited with code -9: starting it again" in server.log()
    finally:
        code = server.stop()
        client.close()
    assert code == 0, server.log()[-2000:]
    # Nothing of the workers is left (their extraction forkservers go a moment after them).
    assert wait_for(
        lambda: not [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("LLMSERVER_WORKER")],
        10,
    )


def test_prometheus_scrapes_every_gateway_and_node_and_alerts_when_a_node_is_gone(hosts: Hosts, tmp_path: Path) -> None:
    """A real Prometheus (Debian's) with the shipped alert rules scrapes both gateways and both nodes
    (metrics_token); a node killed -9 shows as down and LlmserverNodeGone goes pending, then firing.
    Every metric the shipped rules and dashboard query is served by these processes."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support import free_port
    from tests.test_deploy_prometheus import DEPLOY, shipped_metric_names
    from tests.test_docs import undocumented

    key = hosts.key("scraped")
    started = time.time()
    assert [r.status_code for r in load(hosts, key, 8)] == [200] * 8
    refused = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    unknown = httpx.post(
        hosts.gateways[0].url + "/v1/chat/completions", json=refused, headers={"Authorization": f"Bearer {key}"}
    )
    assert unknown.status_code == 404  # a refusal: llmserver_refusals_total has a series
    nodes = [f"{node.address}:8081" for node in hosts.nodes]
    gateways = [f"{gateway.host}:{gateway.port}" for gateway in hosts.gateways]
    # A node's own listener: health, readiness with its components, metrics behind the token.
    for target in nodes:
        assert httpx.get(f"http://{target}/health").json() == {"status": "ok"}
        ready = httpx.get(f"http://{target}/ready").json()
        assert ready["status"] == "ready" and set(ready["components"]) == {"redis", "publishing", "models"}, ready
        assert httpx.get(f"http://{target}/metrics").status_code == 401
    # The instances' last_activity comes from the gateways' use (it stayed at their start before).
    used = [i for i in hosts.instances() if i["last_activity"]]
    assert wait_for(
        lambda: any(
            datetime.fromisoformat(i["last_activity"]).timestamp() >= started - 1 for i in hosts.instances()
        ), 5,
    ), used  # fmt: skip

    token = tmp_path / "token"
    token.write_text(METRICS_TOKEN)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path)
    (tmp_path / "prometheus.yml").write_text(
        json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {"job_name": job, "authorization": {"credentials_file": str(token)},
                 "static_configs": [{"targets": targets}]}
                for job, targets in (("llmserver-gateway", gateways), ("llmserver-node", nodes))
            ],
        })
    )  # fmt: skip
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v1"

    def targets() -> dict[str, str]:
        try:
            active = httpx.get(api + "/targets").json()["data"]["activeTargets"]
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return {t["labels"]["instance"]: t["health"] for t in active}

    def alerts(name: str) -> set[str]:
        found = httpx.get(api + "/alerts").json()["data"]["alerts"]
        return {a["state"] for a in found if a["labels"]["alertname"] == name}

    first = hosts.nodes[0]
    try:
        assert wait_for(lambda: set(targets().values()) == {"up"} and len(targets()) == 4, 30), targets()
        # Every metric the shipped rules and dashboard name, served by a gateway or a node.
        served: set[str] = set()
        for target in [*gateways, *nodes]:
            text = httpx.get(f"http://{target}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
            served |= {family.name for family in text_string_to_metric_families(text)}
        assert shipped_metric_names() <= served, shipped_metric_names() - served
        assert undocumented(served) == set()  # every family, on a gateway or a node, documented
        first.kill()
        assert wait_for(lambda: targets().get(nodes[0]) == "down", 15), targets()
        assert wait_for(lambda: alerts("LlmserverNodeGone") & {"pending", "firing"}, 15)
        assert wait_for(lambda: alerts("LlmserverNodeGone") == {"firing"}, 45)  # `for: 30s`
        assert targets().get(nodes[1]) == "up"
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        if first.process is not None and first.process.poll() is not None:
            first.start()
    assert wait_for(lambda: first.address in hosts.hosts_seen(), 120)


def test_the_worker_hosts_guide_runs_as_written(hosts: Hosts, tmp_path: Path) -> None:
    """docs/operating/worker-hosts.md's commands, on a third worker host and a gateway host, the model
    added from this host: only what names this test's machines is replaced (the addresses, Redis's and
    PostgreSQL's URLs, the certificate files, the shared key, and the node id worker-1, taken by this
    file's first node). The guide's node has no [[models]]: the scheduler assigns it the model added."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "operating" / "worker-hosts.md").read_text()
    commands = re.search(r"```sh\n(.*?)```", page, re.S)
    assert commands is not None
    ca, cert, key = tls_files(hosts.root)
    replacements = {
        "postgresql://llmserver:secret@db.internal/llmserver": hosts.database_url,
        "redis://db.internal:6379/0": hosts.redis.url,
        "10.0.0.21": f"{NET}.{10 + GUIDE_HOST}",
        "/etc/llmserver/worker.pem": str(cert), "/etc/llmserver/worker.key": str(key), "/etc/llmserver/ca.pem": str(ca),
        "SHARED-KEY": SECRET, "LLMSERVER_NODE__ID=worker-1": "LLMSERVER_NODE__ID=worker-guide",
        ".venv/bin/": f"{Path(sys.executable).parent}/",
    }  # fmt: skip
    lines = [line for line in commands[1].splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 3 and " node " in lines[0] and " serve " in lines[1] and " models add " in lines[2], lines
    for old, new in replacements.items():
        lines = [line.replace(old, new) for line in lines]
    namespace = f"llms-w{GUIDE_HOST}"
    add_host(GUIDE_HOST, namespace, BRIDGE, NET)
    processes = []
    try:
        for where, line in ((namespace, lines[0]), ("llms-g1", lines[1])):
            log = tmp_path / f"{where}.log"
            processes.append(spawn(["ip", "netns", "exec", where, "bash", "-c", f"cd {tmp_path} && exec env {line}"],
                                   log, {**os.environ, "LLMSERVER_DATA_DIR": str(tmp_path / where)}))  # fmt: skip
        gateway = f"http://{NET}.21:8000"

        def ready() -> bool:
            try:
                return httpx.get(gateway + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(ready, 120), (tmp_path / "llms-g1.log").read_text()[-3000:]
        added = subprocess.run(["bash", "-c", f"cd {tmp_path} && exec env {lines[2]}"], capture_output=True,
                               text=True, timeout=60, check=False)  # fmt: skip
        assert added.returncode == 0, added.stderr
        created = cli(hosts.root, "keys", "create", "--name", "guide-admin", "--admin",
                      env={"LLMSERVER_STATE__DATABASE_URL": hosts.database_url})  # fmt: skip
        admin = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
        assert wait_for(lambda: any(i["node"] == "worker-guide" for i in
                                    httpx.get(gateway + "/api/instances", headers=admin).json()["data"]), 120), (
            (tmp_path / f"{namespace}.log").read_text()[-3000:])  # fmt: skip
        key = hosts.key("guide")
        answer = httpx.post(gateway + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                            json={"model": "chat", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "chat"
    finally:
        cli(hosts.root, "models", "remove", "chat", env={"LLMSERVER_STATE__DATABASE_URL": hosts.database_url})
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
