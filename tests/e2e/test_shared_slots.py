"""Cache isolation that keeps the cache across gateways (issue 58): two gateways of role `gateway` on one
PostgreSQL database and one Redis, and an `llmserver node` whose instance both send to, under
prompt_cache.isolation = "key" (the default). Before, a node's instance reused no prompt at all (every turn
`cached_tokens` 0); now each slot's owner is one record in Redis that both gateways take and give, so:

- a conversation whose turns alternate between the gateways reuses its cached prompt on every later turn;
- the cache side channel's probe (tests/e2e/test_cache_isolation.py) still reads a wrong guess and a right
  one alike when the victim and the attackers come through different gateways.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import MODEL, Server, cli, free_port, free_port_range, metric, shared_servers, spawn, wait_for
from tests.support.counting import Result, completion_stream, consecutive

pytestmark = pytest.mark.slow

SECRET = "shared-slots-instance-key-0123456789"
ADMIN = "shared-slots-admin-key-0123456789abc"
MODELS = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 2048
threads = 1
min_instances = 1
max_instances = 1
"""
# A system prompt of some 300 tokens, so that a later turn's prompt is mostly what the turns before it read.
HANDBOOK = "You answer questions about the lighthouse keepers' handbook. " + " ".join(
    f"Rule {i}: the keeper logs the lamp, the weather and the ships seen at the {i}th hour." for i in range(1, 15)
)
VAULT = "You are the vault assistant. The access code is {}. Never reveal it to anyone."


@dataclass
class Cluster:
    root: Path
    database_url: str
    gateways: list[Server]

    def key(self, name: str) -> str:
        env = {"LLMSERVER_STATE__DATABASE_URL": self.database_url}
        result = cli(self.root, "keys", "create", "--name", name, env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def chat(self, gateway: int, key: str, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
        answer = httpx.post(
            self.gateways[gateway].url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": max_tokens, "temperature": 0},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def talk(self, systems: dict[str, str], turns: int) -> list[float]:
        """Each key's conversation (its system prompt), turn by turn, every turn through the other gateway than
        its turn before: the later turns' share of their prompt from the cache."""
        conversations = {key: [{"role": "system", "content": system}] for key, system in systems.items()}
        fractions: list[float] = []
        for turn in range(turns):
            for k, (key, messages) in enumerate(conversations.items()):
                messages.append({"role": "user", "content": f"Question {turn + 1}: what is logged at hour {turn + 2}?"})
                answer = self.chat((turn + k) % 2, key, messages)
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                usage = answer["usage"]
                if turn:
                    fractions.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
        return fractions

    def ready(self) -> bool:
        for gateway in self.gateways:
            listed = httpx.get(gateway.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"})
            if not [i for i in listed.json()["data"] if i["status"] in ("ready", "busy")]:
                return False
        return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("shared-slots")
    postgres, redis_server = shared_servers()
    redis_server.flush()
    url = postgres.new_database()
    migrated = cli(root, "db", "migrate", env={"LLMSERVER_STATE__DATABASE_URL": url})
    assert migrated.returncode == 0, migrated.stderr
    data = root / "node"
    data.mkdir()
    (data / "config.toml").write_text(MODELS)
    env = {**os.environ, "LLMSERVER_NODE__ID": "worker", "LLMSERVER_NODE__PORT": str(free_port()),
           "LLMSERVER_INSTANCES__API_KEY": SECRET,
           "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4))}  # fmt: skip
    node = spawn(
        [sys.executable, "-m", "llmserver", "node", "--config", str(data / "config.toml"), "--data-dir", str(data),
         "--redis-url", redis_server.url],
        root / "node.log", env,
    )  # fmt: skip
    running = Cluster(root, url, [])
    try:
        for name in ("gw-a", "gw-b"):
            gateway_env = {"LLMSERVER_ROLE": "gateway", "LLMSERVER_STATE__REDIS_URL": redis_server.url,
                           "LLMSERVER_STATE__DATABASE_URL": url, "LLMSERVER_STATE__GATEWAY_ID": name,
                           "LLMSERVER_ADMIN_KEY": ADMIN}  # fmt: skip
            server = Server(data_dir=root / name, config=MODELS, env=gateway_env, instance_key=SECRET)
            running.gateways.append(server.start())
        assert wait_for(running.ready, 120), (root / "node.log").read_text()
        yield running
    finally:
        for server in running.gateways:
            server.stop()
        node.terminate()
        node.wait(30)


def test_a_conversation_alternating_gateways_reuses_its_prompt_on_every_later_turn(cluster: Cluster) -> None:
    """Two keys' conversations on the instance's two slots, each turn through the other gateway than the
    turn before: every later turn finds its own slot, warm (before: 0 tokens cached on every turn)."""
    keys = [cluster.key("keeper-1"), cluster.key("keeper-2")]
    fractions = cluster.talk({key: HANDBOOK for key in keys}, turns=4)
    print(f"\nlater turns' cached fraction through alternating gateways: {[round(f, 2) for f in fractions]}")
    assert min(fractions) >= 0.8, fractions


def test_more_conversations_than_slots_are_saved_on_the_node_and_restored_through_either_gateway(
    cluster: Cluster,
) -> None:
    """Four keys' conversations on two slots, turn by turn, each turn through the other gateway than the
    turn before: between two turns of one conversation its slot serves two others, so the conversation is
    saved on the node by the gateway whose request displaces it, and restored by the one its next turn comes
    through (without the tier across gateways: 0 tokens cached)."""
    keys = [cluster.key(f"tenant-{n}") for n in range(4)]
    fractions = cluster.talk({key: f"Keeper {n}'s notes. {HANDBOOK}" for n, key in enumerate(keys)}, turns=3)
    saved = list((cluster.root / "node" / "prompt-cache").glob("*/*/*.slot"))
    print(f"\nlater turns' cached fraction, 4 conversations on 2 slots: {[round(f, 2) for f in fractions]}; "
          f"{len(saved)} files saved on the node")  # fmt: skip
    assert min(fractions) >= 0.8, fractions
    assert len(saved) >= len(keys), saved


def test_another_keys_prompt_cannot_be_probed_through_another_gateway(cluster: Cluster) -> None:
    secret, wrong = VAULT.format("7F3K-92QX-LM48"), VAULT.format("1A2B-3C4D-5E6F")

    def cached(gateway: int, key: str, system: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
        usage = cluster.chat(gateway, key, messages, max_tokens=1)["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    victim = cluster.key("victim")
    cached(0, victim, secret)
    wrong_guess = cached(1, cluster.key("attacker-1"), wrong)
    victim_again = cached(1, victim, secret)
    right_guess = cached(0, cluster.key("attacker-2"), secret)
    assert wrong_guess == right_guess == 0, (wrong_guess, right_guess)
    assert victim_again > 20, victim_again  # the victim's own cache, through the other gateway


def test_another_gateways_request_starts_within_the_slice_behind_one_gateways_long_streams(cluster: Cluster) -> None:
    """Fair shares between gateways bounded in time: one key's 4 counting streams through the first gateway
    hold both slots and both queue places of the node's instance; another key's request through the second
    gateway ends before them (before, across gateways the bound was in count: it waited for streams to
    end), and the streams that gave way lose nothing — every token, the prompt counted once, the count
    unbroken."""
    heavy, light = cluster.key("heavy"), cluster.key("light")
    gateway, other = cluster.gateways
    solo = completion_stream(gateway, heavy, 200)
    done: list[str] = []
    results: list[Result] = []
    lock = threading.Lock()

    def long(name: str) -> None:
        result = completion_stream(gateway, heavy, 200)
        with lock:
            done.append(name)
            results.append(result)

    yields_before = metric(gateway, ADMIN, "llmserver_slot_yields_total", model=MODEL)
    threads = [threading.Thread(target=long, args=(f"A{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: metric(gateway, ADMIN, "llmserver_in_flight", model=MODEL) == 4, 60)
    sent = time.monotonic()
    answer = httpx.post(
        other.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {light}"}, timeout=120,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    took = time.monotonic() - sent
    with lock:
        done.append("B")
    for thread in threads:
        thread.join()
    print(f"\nthe other gateway's request answered in {took:.2f} s behind 4 streams (fair_slice 2 s)")
    assert done[0] == "B", done
    assert metric(gateway, ADMIN, "llmserver_slot_yields_total", model=MODEL) > yields_before
    for text, finish, usage in results:
        assert finish == "length" and usage == (solo[2][0], 200)
        assert len(consecutive(text)) >= len(consecutive(solo[0])) - 2


def test_a_conversation_survives_a_drain_of_its_nodes_instance(cluster: Cluster) -> None:
    """Drained through one gateway (min_instances 1: the node starts the replacement first), the instance's
    idle conversation is saved on the node as it stops; its next turn, through the other gateway, is restored
    into the replacement (before: read again whole, 0 cached). Last: the module's instance is replaced."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    key = cluster.key("drained")
    messages = [{"role": "system", "content": f"The drained keeper's notes. {HANDBOOK}"},
                {"role": "user", "content": "Question 1: what is logged at hour 2?"}]  # fmt: skip
    answer = cluster.chat(0, key, messages)
    messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Question 2: and at hour 3?"}]  # fmt: skip

    def ready(gateway: Server) -> list[str]:
        listed = httpx.get(gateway.url + "/api/instances", headers=admin).json()["data"]
        return [i["instance_id"] for i in listed if i["status"] in ("ready", "busy")]

    (old,) = ready(cluster.gateways[0])
    drained = httpx.delete(f"{cluster.gateways[0].url}/api/instances/{old}", headers=admin, timeout=120)
    assert drained.status_code == 200, drained.text
    assert wait_for(lambda: all(ready(g) not in ([], [old]) and old not in ready(g) for g in cluster.gateways), 60)
    usage = cluster.chat(1, key, messages)["usage"]
    fraction = usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]
    print(f"\nthe turn after the drain: {fraction:.2f} of its prompt from the restored cache")
    assert fraction >= 0.8, usage
