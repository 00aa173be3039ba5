"""The prompt-cache affinity policy, without servers: stable, minimal remapping, the load guard."""

from __future__ import annotations

import asyncio
import collections
import itertools

from llmserver.pool.affinity import Candidate, affinity_key, choose, ranked
from tests.support.pool import make_pool, ready_instance

KEYS = [affinity_key("m", f"system prompt {n}", "first message") for n in range(2000)]


def idle(*addresses: str, slots: int = 2) -> list[Candidate]:
    return [Candidate(address, 0, slots) for address in addresses]


def homes(candidates: list[Candidate]) -> dict[str, str]:
    return {key: ranked(key, candidates)[0].address for key in KEYS}


def test_the_same_key_goes_to_the_same_instance_whatever_the_order() -> None:
    candidates = idle("a:1", "b:1", "c:1")
    for key in KEYS[:50]:
        chosen = {choose(key, list(order), margin=1) for order in itertools.permutations(candidates)}
        assert len(chosen) == 1
    assert affinity_key("m", "x", "y") == affinity_key("m", "x", "y") != affinity_key("other", "x", "y")


def test_keys_spread_evenly_and_only_about_one_in_n_move() -> None:
    four = idle("a:1", "b:1", "c:1", "d:1")
    before = homes(four)
    shares = collections.Counter(before.values())
    assert all(0.2 < count / len(KEYS) < 0.3 for count in shares.values()), shares
    after = homes([*four, *idle("e:1")])  # an instance joins: only the keys it takes move, to it
    moved = [key for key in KEYS if after[key] != before[key]]
    assert {after[key] for key in moved} == {"e:1"}
    assert 0.15 < len(moved) / len(KEYS) < 0.25
    without = homes(four[1:])  # an instance leaves: only its own keys move
    assert all(without[key] == before[key] for key in KEYS if before[key] != "a:1")


def test_the_load_guard_gives_way_to_the_next_instance() -> None:
    key = KEYS[0]
    home, second, third = (c.address for c in ranked(key, idle("a:1", "b:1", "c:1")))

    def loads(**in_flight: int) -> list[Candidate]:
        return [Candidate(address, in_flight.get(address.replace(":", "_"), 0), 2) for address in (home, second, third)]

    def name(address: str) -> str:
        return address.replace(":", "_")

    assert choose(key, loads(), margin=1).address == home  # type: ignore[union-attr]
    # Home is full: the next in the key's order, not the least loaded.
    picked = choose(key, loads(**{name(home): 2, name(second): 1}), margin=1)
    assert picked is not None and picked.address == second
    # Home has a free slot but is 2 busier than an idle one: beyond a margin of 1.
    picked = choose(key, loads(**{name(home): 1, name(second): 1}), margin=0)
    assert picked is not None and picked.address == third
    picked = choose(key, loads(**{name(home): 1}), margin=1)
    assert picked is not None and picked.address == home
    # Nothing free: the request queues. No key, or affinity off: the least loaded.
    assert choose(key, [Candidate(home, 2, 2), Candidate(second, 2, 2)], margin=1) is None
    least = choose(None, loads(**{name(home): 1, name(third): 1}), margin=1)
    assert least is not None and least.address == second
    off = choose(key, loads(**{name(home): 1, name(third): 1}), margin=-1)
    assert off is not None and off.address == second


def test_a_pool_sends_a_key_to_its_instance_and_waiters_take_any_freed_slot() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(max_queue=4, parallel=1)
        pool.affinity_margin = 1
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        key = next(k for k in KEYS if ranked(k, idle(a.address, b.address))[0].address == b.address)
        assert await pool.acquire("k1", key) is b  # its home, though both are idle
        assert await pool.acquire("k2", key) is a  # home is full: the other instance
        waiting = asyncio.create_task(pool.acquire("k3", key))
        await asyncio.sleep(0)
        pool.release(a, "k2")  # not its home, but a slot must not stay idle while it waits
        assert await waiting is a
        for instance in (a, b):
            assert instance.client is not None
            await instance.client.close()

    asyncio.run(scenario())
