"""The slot records gateways share for a node's instance (cluster/slots.py), on a real Redis: the same
rule as one host's `Instance.take_slot` (checked against it over random runs), taken atomically by two
gateways at once, holds of a gateway that died lapsing at their deadline, and no reuse while Redis is
down."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio

from llmserver.cluster.slots import GRACE_MS, SLOTS_KEY, SharedSlots
from llmserver.pool.instance import Instance
from llmserver.settings import ModelConfig
from tests.support import free_port
from tests.support.pool import run
from tests.support.services import Redis


def _instance(parallel: int) -> Instance:
    return Instance(model=ModelConfig(name="m", parallel=parallel), host="127.0.0.1", port=1, log_path="/dev/null")  # type: ignore[arg-type]


def test_two_gateways_follow_one_hosts_rule_exactly(redis_server: Redis) -> None:
    """400 random takes and gives through two gateways: each answer (the slot, whether it may reuse the
    slot's prompt) is the one `Instance.take_slot` gives when one gateway sees every request."""

    async def scenario() -> None:
        client = redis.asyncio.from_url(redis_server.url)
        gateways = [SharedSlots(client, "gw-a", 600), SharedSlots(client, "gw-b", 600)]
        rng = random.Random(58)
        for parallel in (1, 2, 4):
            reference = _instance(parallel)
            instance_id = f"rule-{parallel}"
            await client.delete(SLOTS_KEY + instance_id)
            holding: list[tuple[int, str, str, int, SharedSlots]] = []  # slot, hold, key, start, gateway
            for _ in range(400):
                if holding and (rng.random() < 0.45 or len(holding) > 2 * parallel):
                    slot, hold, key, start, gateway = holding.pop(rng.randrange(len(holding)))
                    finished = rng.random() < 0.85
                    await gateway.give(instance_id, parallel, slot, hold, finished)
                    reference.give_slot(slot, finished, (key, start, 100))
                    continue
                key, start, gateway = rng.choice("ABC"), rng.choice((11, 2**63 - 25)), rng.choice(gateways)
                taken = await gateway.claim(instance_id, parallel, key, start)  # take, without its wait
                assert taken is not None
                expected = reference.take_slot(key, start)
                assert taken[:2] == expected[:2], (parallel, key, start, taken, expected)
                holding.append((taken[0], taken[2], key, start, gateway))
        await client.aclose()

    run(scenario)


def test_a_conversation_finds_its_slot_through_either_gateway_and_no_other_key_reuses_it(redis_server: Redis) -> None:
    async def scenario() -> None:
        client = redis.asyncio.from_url(redis_server.url)
        a, b = SharedSlots(client, "gw-a", 600), SharedSlots(client, "gw-b", 600)
        await client.delete(SLOTS_KEY + "conv")
        first = await a.take("conv", 2, "victim", 7)
        assert first is not None and first[:2] == (0, False)
        await a.give("conv", 2, 0, first[2], True)
        other = await b.take("conv", 2, "attacker", 7)  # the same start: the other idle slot, nothing reused
        assert other is not None and other[:2] == (1, False)
        await b.give("conv", 2, 1, other[2], True)
        again = await b.take("conv", 2, "victim", 7)  # its next turn, through the other gateway
        assert again is not None and again[:2] == (0, True)
        # Both slots busy: the attacker shares the victim's slot and may not reuse it.
        busy = await a.take("conv", 2, "attacker", 7)
        assert busy is not None and busy[:2] == (1, True)  # its own slot, idle
        third = await a.take("conv", 2, "attacker", 9)
        assert third is not None and third[1] is False
        await client.aclose()

    run(scenario)


def test_two_gateways_taking_at_once_never_get_the_same_idle_slot(redis_server: Redis) -> None:
    async def scenario() -> None:
        client_a, client_b = redis.asyncio.from_url(redis_server.url), redis.asyncio.from_url(redis_server.url)
        a, b = SharedSlots(client_a, "gw-a", 600), SharedSlots(client_b, "gw-b", 600)
        for round_ in range(20):
            instance_id = f"race-{round_}"
            taken = await asyncio.gather(*(g.take(instance_id, 4, f"k{i}", i) for i, g in enumerate([a, b] * 2)))
            assert sorted(t[0] for t in taken if t is not None) == [0, 1, 2, 3]
        await client_a.aclose()
        await client_b.aclose()

    run(scenario)


def test_a_dead_gateways_hold_lapses_at_its_deadline_and_leaves_the_slot_nobodys(redis_server: Redis) -> None:
    async def scenario() -> None:
        client = redis.asyncio.from_url(redis_server.url)
        alive = SharedSlots(client, "gw-b", 600)
        dead = SharedSlots(client, "gw-dead", 0)  # its holds' deadline is now: as if its gateway died long ago
        await client.delete(SLOTS_KEY + "held", SLOTS_KEY + "lapsed")
        for gateway, instance_id in ((alive, "held"), (dead, "lapsed")):
            held = await gateway.take(instance_id, 1, "victim", 7)  # never given back
            assert held is not None
        # A live hold: the key's next request shares the busy slot, all its own key's since idle.
        during = await alive.take("held", 1, "victim", 7)
        assert during is not None and during[1] is True
        # A lapsed one: the slot's last request may have ended anywhere, so its prompt is nobody's.
        after = await alive.take("lapsed", 1, "victim", 7)
        assert after is not None and after[1] is False
        await client.aclose()

    run(scenario)


def test_another_keys_request_on_a_slot_just_taken_waits_out_the_grace(redis_server: Redis) -> None:
    """Key A was told to reuse its slot's prompt; key B's request, pinned to the same (busy) slot just after,
    must not reach llama-server before A's, or A's cached_tokens would measure B's prompt."""

    async def scenario() -> None:
        client = redis.asyncio.from_url(redis_server.url)
        a, b = SharedSlots(client, "gw-a", 600), SharedSlots(client, "gw-b", 600)
        await client.delete(SLOTS_KEY + "grace")
        first = await a.claim("grace", 1, "A", 7)
        assert first is not None
        await a.give("grace", 1, 0, first[2], True)
        mine = await a.claim("grace", 1, "A", 7)  # told to reuse its own prompt
        assert mine is not None and mine[1] is True and mine[3] == 0
        same_key = await a.claim("grace", 1, "A", 7)  # its own key's next request: no wait
        assert same_key is not None and same_key[3] == 0
        other = await b.claim("grace", 1, "B", 9)
        assert other is not None and other[1] is False
        assert 0 < other[3] <= GRACE_MS  # the rest of the grace since A's take
        await client.aclose()

    run(scenario)


def test_without_redis_nothing_is_reused() -> None:
    async def scenario() -> None:
        client = redis.asyncio.from_url(f"redis://127.0.0.1:{free_port()}/0")
        slots = SharedSlots(client, "gw-a", 600)
        assert await slots.take("gone", 2, "victim", 7) is None
        await slots.give("gone", 2, 0, "gw-a:1", True)  # a give that cannot be written lapses; no error
        await client.aclose()

    run(scenario)
