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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import MODEL, Server, cli, free_port, free_port_range, shared_servers, spawn, wait_for

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
    conversations: list[list[dict[str, str]]] = [[{"role": "system", "content": HANDBOOK}] for _ in keys]
    fractions: list[float] = []
    for turn in range(4):
        for k, key in enumerate(keys):
            messages = conversations[k]
            messages.append({"role": "user", "content": f"Question {turn + 1}: what is logged at hour {turn + 2}?"})
            answer = cluster.chat((turn + k) % 2, key, messages)
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            usage = answer["usage"]
            if turn:
                fractions.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
    print(f"\nlater turns' cached fraction through alternating gateways: {[round(f, 2) for f in fractions]}")
    assert min(fractions) >= 0.8, fractions


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
