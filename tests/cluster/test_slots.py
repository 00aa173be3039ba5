"""The slot records gateways share for a node's instance (cluster/slots.py), on a real Redis: the same
rule as one host's `Instance.take_slot` (checked against it over random runs), taken atomically by two
gateways at once, turns on a slot as pool/slot_gate.py gives them, holds renewed while they last and lapsing
when their gateway is gone, the grace before another key's request, and no reuse while Redis is down."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import redis.asyncio

from llmserver.cluster.slots import GRACE_MS, SAVED_KEY, SLOTS_KEY, Claim, SharedSlots, sweep_superseded
from llmserver.llama.client import LlamaServerClient
from llmserver.pool.instance import Instance
from llmserver.pool.saved_prompts import SavedPrompts
from llmserver.settings import ModelConfig
from tests.support import free_port
from tests.support.pool import run
from tests.support.services import Redis

LONG = 1000  # prompt bytes worth keeping (min_tokens 256): such a request has the slot to itself


def _instance(parallel: int) -> Instance:
    return Instance(model=ModelConfig(name="m", parallel=parallel), host="127.0.0.1", port=1, log_path="/dev/null")  # type: ignore[arg-type]


@asynccontextmanager
async def connected(redis_server: Redis, *instances: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.from_url(redis_server.url)
    try:
        if instances:
            await client.delete(*(SLOTS_KEY + instance for instance in instances))
        yield client
    finally:
        await client.aclose()


def test_two_gateways_follow_one_hosts_rule_exactly(redis_server: Redis) -> None:
    """400 random takes and gives through two gateways: each answer (the slot, whether it may reuse the
    slot's prompt) is the one `Instance.take_slot` gives when one gateway sees every request."""

    async def scenario() -> None:
        async with connected(redis_server, "rule-1", "rule-2", "rule-4") as client:
            gateways = [SharedSlots(client, "gw-a"), SharedSlots(client, "gw-b")]
            rng = random.Random(58)
            for parallel in (1, 2, 4):
                reference = _instance(parallel)
                instance_id = f"rule-{parallel}"
                holding: list[tuple[int, str, str, int, SharedSlots]] = []  # slot, hold, key, start, gateway
                for _ in range(400):
                    if holding and (rng.random() < 0.45 or len(holding) > 2 * parallel):
                        slot, hold, key, start, gateway = holding.pop(rng.randrange(len(holding)))
                        finished = rng.random() < 0.85
                        await gateway.give(instance_id, parallel, slot, hold, finished, (key, start, 100))
                        reference.give_slot(slot, finished, (key, start, 100))
                        continue
                    key, start, gateway = rng.choice("ABC"), rng.choice((11, 2**63 - 25)), rng.choice(gateways)
                    claim = await gateway.claim(instance_id, parallel, key, start)
                    assert claim is not None
                    expected = reference.take_slot(key, start)
                    assert (claim.slot, claim.reuse) == expected[:2], (parallel, key, start, claim, expected)
                    holding.append((claim.slot, claim.hold, key, start, gateway))

    run(scenario)


def test_a_conversation_finds_its_slot_through_either_gateway_and_no_other_key_reuses_it(redis_server: Redis) -> None:
    async def scenario() -> None:
        async with connected(redis_server, "conv") as client:
            a, b = SharedSlots(client, "gw-a"), SharedSlots(client, "gw-b")
            first = await a.pin("conv", 2, "victim", 7, 100)
            assert first is not None and first[:2] == (0, False)
            await a.give("conv", 2, 0, first[2], True, ("victim", 7, 100))
            other = await b.pin("conv", 2, "attacker", 7, 100)  # the same start: the other idle slot, no reuse
            assert other is not None and other[:2] == (1, False)
            await b.give("conv", 2, 1, other[2], True, ("attacker", 7, 100))
            again = await b.pin("conv", 2, "victim", 7, 100)  # its next turn, through the other gateway
            assert again is not None and again[:2] == (0, True)
            busy = await a.pin("conv", 2, "attacker", 9, 100)  # its own slot, idle
            assert busy is not None and busy[:2] == (1, True)
            third = await a.pin("conv", 2, "attacker", 7, 100)  # both busy: the least held, no reuse
            assert third is not None and third[1] is False

    run(scenario)


def test_two_gateways_taking_at_once_never_get_the_same_idle_slot(redis_server: Redis) -> None:
    async def scenario() -> None:
        instances = [f"race-{n}" for n in range(20)]
        async with connected(redis_server, *instances) as client_a, connected(redis_server) as client_b:
            a, b = SharedSlots(client_a, "gw-a"), SharedSlots(client_b, "gw-b")
            for instance_id in instances:
                taken = await asyncio.gather(*(g.claim(instance_id, 4, f"k{i}", i) for i, g in enumerate([a, b] * 2)))
                assert sorted(t.slot for t in taken if t is not None) == [0, 1, 2, 3]

    run(scenario)


def test_turns_on_a_slot_are_one_hosts_alone_or_shared_first_come_first_served(
    redis_server: Redis, tmp_path: Path
) -> None:
    """With the tier on: a long prompt has the slot to itself, short ones share it, nobody overtakes, and a
    short one that finds a conversation worth keeping in the slot goes alone to save it."""

    async def scenario() -> None:
        async with connected(redis_server, "turns") as client:
            saved = SavedPrompts(tmp_path, 64, 256)  # its settings only: nothing is saved here
            a, b = SharedSlots(client, "gw-a", saved=saved), SharedSlots(client, "gw-b", saved=saved)
            short_1 = await a.claim("turns", 1, "S", 1, 100, gated=True)
            short_2 = await b.claim("turns", 1, "S", 1, 100, gated=True)
            assert short_1 and short_2 and short_1.turn and short_2.turn and not short_1.alone  # shared
            long = await a.claim("turns", 1, "L", 2, LONG, gated=True)
            assert long is not None and long.alone and not long.turn  # waits for both
            late = await b.claim("turns", 1, "S", 1, 100, gated=True)
            assert late is not None and not late.turn  # does not overtake the long one
            await a.give("turns", 1, 0, short_1.hold, True, ("S", 1, 100))
            await b.give("turns", 1, 0, short_2.hold, True, ("S", 1, 100))
            assert await a.wait_turn("turns", 1, long, "L", 2)
            assert long.held == ("S", "1", 100)  # exactly what the slot holds: not worth keeping (< 256)
            await a.give("turns", 1, 0, long.hold, True, ("L", 2, LONG))
            # The late short one now finds a conversation worth keeping in the slot: it goes alone.
            assert await b.wait_turn("turns", 1, late, "S", 1)
            assert late.alone and late.held == ("L", "2", LONG)
            await b.give("turns", 1, 0, late.hold, True, ("S", 1, 100))
            # A gateway whose own tier is off still takes turns where the node saves (another gateway may
            # restore a conversation into the slot): its long prompt goes alone.
            off = SharedSlots(client, "gw-off")
            engine = LlamaServerClient("http://127.0.0.1:1")  # never called: this gateway saves nothing
            pinned = await off.pin("turns", 1, "L", 2, LONG, engine, "node-1:identity")
            assert pinned is not None
            (entry,) = json.loads(await client.get(SLOTS_KEY + "turns"))["slots"][0]["q"]
            assert entry["al"] == 1 and entry["e"] == 1
            await engine.close()

    run(scenario)


def test_holds_are_renewed_while_they_last_and_a_dead_gateways_lapse(redis_server: Redis) -> None:
    async def scenario() -> None:
        async with connected(redis_server, "held", "lapsed") as client:
            alive = SharedSlots(client, "gw-b", hold_seconds=5)
            dead = SharedSlots(client, "gw-dead", hold_seconds=0)  # deadline now: as if it died long ago
            held = await alive.claim("held", 1, "victim", 7)
            assert held is not None
            assert await dead.claim("lapsed", 1, "victim", 7) is not None  # never given back
            before = json.loads(await client.get(SLOTS_KEY + "held"))["slots"][0]["q"][0]["d"]
            alive.hold_ms = 600_000
            await alive.renew_once()
            after = json.loads(await client.get(SLOTS_KEY + "held"))["slots"][0]["q"][0]["d"]
            assert after - before > 500_000
            # A live hold: the key's next request shares the busy slot, all its own key's since idle.
            during = await alive.claim("held", 1, "victim", 7)
            assert during is not None and during.reuse
            # A lapsed one: the slot's last request may have ended anywhere, so its prompt is nobody's.
            lapsed = await alive.claim("lapsed", 1, "victim", 7)
            assert lapsed is not None and not lapsed.reuse

    run(scenario)


def test_another_keys_request_on_a_slot_just_taken_waits_out_the_grace(redis_server: Redis) -> None:
    """Key A was told to reuse its slot's prompt; key B's request, pinned to the same (busy) slot just after,
    must not reach llama-server before A's, or A's cached_tokens would measure B's prompt."""

    async def scenario() -> None:
        async with connected(redis_server, "grace") as client:
            a, b = SharedSlots(client, "gw-a"), SharedSlots(client, "gw-b")
            first = await a.claim("grace", 1, "A", 7)
            assert first is not None
            await a.give("grace", 1, 0, first.hold, True, ("A", 7, 100))
            mine = await a.claim("grace", 1, "A", 7)  # told to reuse its own prompt
            assert mine is not None and mine.reuse and mine.wait_ms == 0
            same_key = await a.claim("grace", 1, "A", 7)  # its own key's next request: no wait
            assert same_key is not None and same_key.wait_ms == 0
            other = await b.claim("grace", 1, "B", 9)
            assert other is not None and not other.reuse
            assert 0 < other.wait_ms <= GRACE_MS  # the rest of the grace since A's take

    run(scenario)


def test_a_node_removes_the_saved_prompts_no_index_names_once_old_enough(redis_server: Redis, tmp_path: Path) -> None:
    """A conversation saved again (a later turn) gets a new file and the index names it: the earlier file goes;
    a file just written, not indexed yet, stays."""

    async def scenario() -> None:
        folder = tmp_path / "m-1234" / "identity"
        folder.mkdir(parents=True)
        for name in ("current.slot", "superseded.slot", "just-written.slot"):
            (folder / name).write_bytes(b"state")
        long_ago = time.time() - 3600
        os.utime(folder / "current.slot", (long_ago, long_ago))
        os.utime(folder / "superseded.slot", (long_ago, long_ago))
        async with connected(redis_server) as client:
            await client.delete(SAVED_KEY + "node-1:identity")
            await client.hset(SAVED_KEY + "node-1:identity", "conversation", "current.slot")
            assert await sweep_superseded(client, "node-1", tmp_path) == 1
        assert sorted(path.name for path in folder.iterdir()) == ["current.slot", "just-written.slot"]

    run(scenario)


def test_without_redis_nothing_is_reused() -> None:
    async def scenario() -> None:
        client = redis.asyncio.from_url(f"redis://127.0.0.1:{free_port()}/0")
        slots = SharedSlots(client, "gw-a")
        assert await slots.pin("gone", 2, "victim", 7, 100) is None
        await slots.give("gone", 2, 0, "gw-a:1", True)  # a give that cannot be written lapses; no error
        # A request waiting for its turn when Redis goes stops waiting (it is then sent reusing nothing).
        waiting = Claim(slot=0, reuse=True, hold="gw-a:2", wait_ms=0, turn=False, alone=True, held=None)
        assert await slots.wait_turn("gone", 2, waiting, "victim", 7) is False
        await client.aclose()

    run(scenario)
