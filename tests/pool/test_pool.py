"""The model pool's queue and the scale-up rule, on pool objects without processes behind them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from llmserver.cluster.remote import RemoteInstance
from llmserver.errors import GatewayTimeout, Overloaded
from llmserver.llama.client import LlamaServerClient
from llmserver.pool.affinity import Candidate, ranked
from llmserver.pool.instance import ORDER_GRACE, Instance, Status, llama_server_args, slot_context
from llmserver.pool.pool import ModelPool, Turn
from llmserver.pool.router import Lease
from llmserver.pool.saved_prompts import SavedPrompts
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import ModelConfig, Settings
from tests.support.pool import close, make_pool, ready_instance, run


def test_least_loaded_instance_then_fifo_queue_then_503() -> None:
    async def scenario() -> None:
        pool, pressured = make_pool(max_queue=2, parallel=2)
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        assert await pool.acquire("k1") is a
        assert await pool.acquire("k2") is b  # the least loaded
        assert await pool.acquire("k1") is a
        assert await pool.acquire("k3") is b
        assert (a.status, b.status, len(a.users)) == (Status.BUSY, Status.BUSY, 1)
        first = asyncio.create_task(pool.acquire("w1"))
        second = asyncio.create_task(pool.acquire("w2"))
        await asyncio.sleep(0)
        assert pool.queue_depth == 2 and pressured == [pool, pool]
        with pytest.raises(Overloaded) as caught:
            await pool.acquire("w3")
        assert caught.value.headers["Retry-After"] == "2"
        pool.release(b, "k2")
        assert await first is b  # first come, first served
        pool.release(a, "k1")
        assert await second is a
        assert pool.queue_depth == 0
        await close(a, b)

    run(scenario)


def test_every_slot_first_then_the_instances_own_queues_then_the_gateways() -> None:
    async def scenario() -> None:
        pool, pressured = make_pool(max_queue=1, parallel=2, instance_queue=1)
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        for key in ("k1", "k2", "k3", "k4"):  # the four slots, least loaded first: no pressure yet
            await pool.acquire(key)
        assert (a.in_flight, b.in_flight, pressured) == (2, 2, [])
        # Every slot taken: one more request on each instance, which starts it when a slot frees.
        assert {await pool.acquire("q1"), await pool.acquire("q2")} == {a, b}
        assert (a.load, b.load, a.status, pool.queue_depth) == (3, 3, Status.BUSY, 0)
        assert pressured == [pool, pool]  # the supervisor hears of it: another instance may be due
        waiter = asyncio.create_task(pool.acquire("w1"))  # then the gateway's queue, bounded as before
        await asyncio.sleep(0)
        assert pool.queue_depth == 1
        with pytest.raises(Overloaded):
            await pool.acquire("w2")
        pool.release(b, "k2")
        assert await waiter is b and b.load == 3
        await close(a, b)

    run(scenario)


def test_an_affinity_takes_a_free_slot_elsewhere_before_its_instances_queue() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(max_queue=1, parallel=2, instance_queue=2)
        pool.affinity_margin = 100  # the preferred instance whatever its load, while it has room
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        key = next(
            f"c{i}"
            for i in range(100)
            if ranked(f"c{i}", [Candidate(a.address, 0, 2), Candidate(b.address, 0, 2)])[0].address == a.address
        )
        assert await pool.acquire("k", key) is a
        assert await pool.acquire("k", key) is a
        assert await pool.acquire("k", key) is b  # a's slots are taken, b has one free
        assert await pool.acquire("k", key) is b
        assert await pool.acquire("k", key) is a  # every slot taken: the preferred instance's queue
        await close(a, b)

    run(scenario)


def test_an_affinity_key_is_asked_for_only_where_there_is_a_choice_of_instance() -> None:
    async def scenario() -> None:
        pool, _ = make_pool()
        pool.affinity_margin = 2
        assert pool.chooses  # no instance yet: the one that starts may not stay alone
        a = await ready_instance(pool.config, 1)
        pool.instances.append(a)
        assert not pool.chooses  # one instance, and max_instances 1: nothing to choose
        pool.config = pool.config.model_copy(update={"max_instances": 2})
        assert pool.chooses
        pool.affinity_margin = -1  # router.policy = "least_loaded"
        assert not pool.chooses
        await close(a)

    run(scenario)


def test_an_instance_holds_its_slots_and_its_queue_by_default() -> None:
    model = ModelConfig(name="m", parallel=3)
    assert (model.instance_queue, model.most_in_flight) == (None, 6)
    assert ModelConfig(name="m", parallel=3, instance_queue=0).most_in_flight == 3
    # llama-server is given an HTTP thread for each of them, and room for probes (it drops the rest).
    args = llama_server_args(Path("llama-server"), Path("m.gguf"), model, "127.0.0.1", 8080)
    assert args[args.index("--threads-http") + 1] == "10"

    async def scenario() -> None:
        pool = ModelPool(model, queue_timeout=5.0, on_pressure=lambda pool: None)
        only = await ready_instance(model, 1)
        pool.instances.append(only)
        for i in range(6):
            assert await pool.acquire(f"k{i}") is only
        waiter = asyncio.create_task(pool.acquire("w"))
        await asyncio.sleep(0)
        assert (only.load, pool.queue_depth) == (6, 1)
        pool.release(only, "k0")
        assert await waiter is only
        await close(only)

    run(scenario)


def test_queue_wait_times_out_with_504_and_cancelled_waiters_leak_nothing() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(queue_timeout=0.2)
        only = await ready_instance(pool.config, 1)
        pool.instances.append(only)
        await pool.acquire("busy")
        with pytest.raises(GatewayTimeout):
            await pool.acquire("patient")
        waiter = asyncio.create_task(pool.acquire("leaver"))
        await asyncio.sleep(0)
        pool.release(only, "busy")  # hands the slot to the waiter ...
        waiter.cancel()  # ... which leaves before it could use it
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert only.in_flight == 0 and only.status == Status.READY and not only.users
        await close(only)

    run(scenario)


def test_scale_up_respects_max_instances_and_memory_budget() -> None:
    async def scenario() -> None:
        model = ModelConfig(name="m", min_instances=1, max_instances=2)
        supervisor = Supervisor(Settings(models=[model], instances={"memory_budget_mb": 1000}))
        pool = supervisor.pools["m"]
        running = await ready_instance(pool.config, 1)
        running.ram_used_mb = 600
        pool.instances.append(running)
        supervisor.scale_up(pool)  # 600 in use + ~600 for another > 1000
        assert len(pool.instances) == 1 and not supervisor._tasks
        running.ram_used_mb = 400
        pool.instances.append(await ready_instance(pool.config, 2))
        supervisor.scale_up(pool)  # at max_instances: nothing to do
        assert not supervisor._tasks
        for instance in pool.instances:
            assert instance.client is not None
            await instance.client.close()

    run(scenario)


def test_no_running_instance_is_503_at_once() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(queue_timeout=30)
        given_up = await ready_instance(pool.config, 1)
        given_up.status = Status.FAILED
        pool.instances.append(given_up)
        with pytest.raises(Overloaded) as caught:
            await pool.acquire("k")
        assert "No instance" in caught.value.message and caught.value.headers["Retry-After"] == "30"
        given_up.restarting = True  # coming back: wait for it instead
        waiter = asyncio.create_task(pool.acquire("k"))
        await asyncio.sleep(0)
        assert pool.queue_depth == 1
        given_up.restarting, given_up.status = False, Status.READY
        pool.dispatch()
        assert await waiter is given_up
        assert given_up.client is not None
        await given_up.client.close()

    run(scenario)


def test_slot_context_is_what_llama_cpp_gives_each_slot() -> None:
    assert slot_context(ModelConfig(name="m", ctx_size=4096, parallel=4)) == 4096
    assert slot_context(ModelConfig(name="m", ctx_size=128, parallel=1)) == 256  # padded to 256 in all
    assert slot_context(ModelConfig(name="m", ctx_size=1000, parallel=4)) == 1024


def test_a_retry_avoids_the_instance_it_failed_on_while_another_accepts() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(parallel=2)
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        assert await pool.acquire("k", avoid=a) is b
        assert await pool.acquire("k", avoid=a) is b  # b is busier than a now: still not a
        b.status = Status.FAILED
        assert await pool.acquire("k", avoid=a) is a  # the only one accepting
        await close(a, b)

    run(scenario)


def test_a_retry_after_a_node_failed_goes_to_another_node() -> None:
    """Two instances on node n1, one on n2: a request that failed on n1 is retried on n2 (n1's other
    instance would likely fail the same way, a killed host's), and while n1 is suspected (its instance
    dropped a connection: cluster/registry.py) none of its instances takes a request at all."""

    async def scenario() -> None:
        pool, _ = make_pool(parallel=4)
        on = {}
        for port, (name, node) in enumerate((("a", "n1"), ("b", "n1"), ("c", "n2")), 1):
            instance = RemoteInstance(model=pool.config, host="127.0.0.1", port=port, log_path=Path("/dev/null"),
                                      node=node)  # fmt: skip
            instance.client, instance.status = LlamaServerClient(instance.base_url), Status.READY
            on[name] = instance
        pool.instances += list(on.values())
        for _ in range(3):  # c gets busier each time, and is still chosen
            assert await pool.acquire("k", avoid=on["a"]) is on["c"]
        on["a"].suspect = on["b"].suspect = True
        assert not on["b"].accepting and await pool.acquire("k") is on["c"]
        on["c"].status = Status.FAILED
        assert not pool.ready  # n1 suspected, n2's one failed: nothing to route to until n1 answers
        on["a"].suspect = on["b"].suspect = False
        assert await pool.acquire("k", avoid=on["a"]) is on["b"]  # no other node: another instance
        await close(*on.values())

    run(scenario)


def test_other_gateways_requests_count_toward_load_queue_bound_and_fair_share() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(max_queue=2, parallel=2)
        a, b = await ready_instance(pool.config, 1), await ready_instance(pool.config, 2)
        pool.instances += [a, b]
        a.elsewhere = 2  # another gateway holds both of a's slots
        a.refresh_status()
        assert a.status == Status.BUSY
        assert await pool.acquire("k") is b
        assert await pool.acquire("k") is b  # a is full, though this gateway has nothing on it
        pool.queued_elsewhere = 1  # another gateway has a request waiting: one place left here
        waiter = asyncio.create_task(pool.acquire("k"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await pool.acquire("k")
        a.elsewhere = 1  # the other gateway freed a slot: the next read of the registry hands it over
        pool.dispatch()
        assert await waiter is a
        # While others wait, this gateway (3 of 4 slots) keeps to its share (2): a freed slot stays free.
        pool.share = 2
        pool.release(b, "k")
        assert b.in_flight == 1 and pool.queue_depth == 0
        held = asyncio.create_task(pool.acquire("k"))
        await asyncio.sleep(0)
        assert not held.done() and pool.queue_depth == 1
        pool.share = None  # nobody else waits any more
        pool.dispatch()
        assert await held is b
        await close(a, b)

    run(scenario)


def test_a_freed_place_goes_to_the_waiting_key_holding_the_fewest() -> None:
    """One key's backlog does not stand in front of another key's request (issue 39, row 2): first come
    first served was the order, and a short request behind 16 long streams waited 60 s for a 504."""

    async def scenario() -> None:
        pool, _ = make_pool(max_queue=16, parallel=2)
        instance = await ready_instance(pool.config, 1)
        pool.instances.append(instance)
        assert await pool.acquire("heavy") is instance
        assert await pool.acquire("heavy") is instance
        backlog = [asyncio.create_task(pool.acquire("heavy")) for _ in range(4)]
        await asyncio.sleep(0)
        light = asyncio.create_task(pool.acquire("light"))
        other = asyncio.create_task(pool.acquire("other"))
        await asyncio.sleep(0)
        pool.release(instance, "heavy")  # the first free place: the light key, though it came after the backlog
        await asyncio.sleep(0)
        assert light.done() and not other.done() and not any(t.done() for t in backlog)
        pool.release(instance, "heavy")  # then the other key (it holds none, as heavy holds none now either,
        await asyncio.sleep(0)  # but heavy was served more recently)
        assert other.done() and not any(t.done() for t in backlog)
        pool.release(instance, "light")
        await asyncio.sleep(0)
        assert backlog[0].done() and not any(t.done() for t in backlog[1:])  # a key's own requests: in order
        pool.release(instance, "other")
        await asyncio.sleep(0)
        assert backlog[1].done()
        for _ in range(2):
            pool.release(instance, "heavy")
            await asyncio.sleep(0)
        assert all(t.done() for t in backlog)
        assert pool._served == {"heavy": pool._served["heavy"]}  # only keys holding places are remembered
        await close(instance)

    run(scenario)


def test_a_slot_is_reused_only_by_the_key_whose_prompt_it_holds() -> None:
    async def scenario() -> None:
        instance = await ready_instance(ModelConfig(name="m", parallel=2), 1)
        assert instance.take_slot("victim", 7) == (0, False, False)  # nobody's prompt yet
        instance.give_slot(0)
        assert instance.take_slot("attacker", 7) == (1, False, False)  # the other idle slot, never the victim's reuse
        instance.give_slot(1)
        assert instance.take_slot("victim", 7) == (0, True, True)  # its own prompt, same start
        assert instance.take_slot("victim", 7) == (1, False, False)  # slot 0 is busy: the attacker's slot, no reuse
        assert instance.take_slot("other", 9) == (0, False, False)  # every slot busy: the least held, no reuse
        for slot in (0, 1, 0):
            instance.give_slot(slot)
        # Slot 0 ran a victim's and then another key's request: its owner is unknown, reused by none.
        assert instance.take_slot("victim", 7) == (1, True, True)  # slot 1: the victim's last, idle
        assert instance.take_slot("other", 9) == (0, False, False)
        await close(instance)

    run(scenario)


def test_a_long_prompt_waits_for_whichever_slot_is_idle_first_and_short_ones_queue_behind_it() -> None:
    """Saved prompts on: a long prompt (it will have its slot to itself) is not pinned to a busy slot but
    takes the first slot to become idle, as llama-server's own queue would; first come first served, short
    requests behind it too, and one that gives up hands its turn on."""

    async def idle_slot(instance: Instance, alone: bool) -> None:
        if (waiting := instance.idle_slot(alone)) is not None:
            await waiting

    async def scenario() -> None:
        instance = await ready_instance(ModelConfig(name="m", parallel=2), 1)
        assert instance.idle_slot(True) is None  # a slot is idle: at once
        assert instance.idle_slot(False) is None
        assert instance.take_slot("a", 1)[0] == 0 and instance.take_slot("b", 2)[0] == 1
        assert instance.idle_slot(False) is None  # nobody waits: a short request shares a busy slot at once
        long_one = asyncio.ensure_future(idle_slot(instance, True))
        gone = asyncio.ensure_future(idle_slot(instance, True))
        short = asyncio.ensure_future(idle_slot(instance, False))
        await asyncio.sleep(0)
        assert not any(t.done() for t in (long_one, gone, short))
        instance.give_slot(1)  # slot 1 frees first, though slot 0 was taken longer ago
        await asyncio.sleep(0)
        assert long_one.done() and not gone.done() and not short.done()
        assert instance.take_slot("c", 3)[0] == 1  # the idle one
        gone.cancel()
        await asyncio.sleep(0)
        assert not short.done()
        instance.give_slot(0)
        await asyncio.sleep(0)
        assert short.done() and instance.take_slot("d", 4)[0] == 0
        assert not instance._idle_waiters and instance._idle_promised == 0
        await close(instance)

    run(scenario)


def test_another_keys_request_on_a_slot_just_taken_to_reuse_its_cache_is_sent_after_it() -> None:
    """The pins decide in the order of takes; the slot's requests run in the order they reach llama-server.
    A request of another key pinned to a slot that a reusing request took under ORDER_GRACE ago waits out the
    rest, so the reusing one's `cached_tokens` never measures the other's prompt."""

    async def scenario() -> None:
        instance = await ready_instance(ModelConfig(name="m", parallel=1), 1)
        assert instance.take_slot("victim", 7) == (0, False, False)
        assert instance.order_wait(0, "other") == 0.0  # nobody took it to reuse
        instance.give_slot(0, conversation=("victim", 7, 900))
        assert instance.take_slot("victim", 7) == (0, True, True)  # told to reuse its own prompt
        assert instance.take_slot("other", 9) == (0, False, False)  # pinned behind it, no reuse
        assert 0.0 < instance.order_wait(0, "other") <= ORDER_GRACE
        assert instance.order_wait(0, "victim") == 0.0  # the same key's: nothing to learn
        await asyncio.sleep(ORDER_GRACE)
        assert instance.order_wait(0, "other") == 0.0
        await close(instance)

    run(scenario)


def test_a_key_queued_behind_its_own_request_reuses_the_slots_prompt() -> None:
    """An agent's retry, queued while its first try still runs, reads its prompt from the cache."""

    async def scenario() -> None:
        instance = await ready_instance(ModelConfig(name="m", parallel=1), 1)
        assert instance.take_slot("agent", 7) == (0, False, False)
        assert instance.take_slot("agent", 7) == (0, True, True)  # busy, but only with this key's requests
        assert instance.take_slot("other", 9) == (0, False, False)  # another key's: never
        assert instance.take_slot("agent", 7) == (0, False, False)  # the slot's last prompt is no longer known
        for _ in range(3):
            instance.give_slot(0)
        assert instance.take_slot("agent", 7) == (0, False, False)
        await close(instance)

    run(scenario)


def test_a_slot_whose_request_ended_early_is_taken_last() -> None:
    """A timed-out or abandoned request may still hold its slot in llama-server for a moment: a request
    pinned there would wait behind it (a stream then timed out before its first event)."""

    async def scenario() -> None:
        instance = await ready_instance(ModelConfig(name="m", parallel=2), 1)
        assert instance.take_slot("a", 1) == (0, False, False)
        instance.give_slot(0, finished=False)  # a timeout: the slot may still be working
        assert instance.take_slot("b", 2) == (1, False, False)
        instance.give_slot(1)
        assert instance.take_slot("a", 1) == (1, False, False)  # not its old slot 0 (unsure, and no longer its cache)
        assert instance.take_slot("c", 3) == (0, False, False)  # the only idle one left: taken
        instance.give_slot(0)
        instance.give_slot(1)
        assert instance.take_slot("c", 3) == (0, True, True)  # it ended normally: c's again
        instance.give_slot(0)
        assert instance.take_slot("a", 1) == (1, True, True)  # a's conversation, where it was left
        # Another conversation of c's (start 4): slot 0 holds c's prompt (reuse of its common start) but
        # not this one (not warm: a saved copy of this conversation would be restored into it).
        assert instance.take_slot("c", 4) == (0, True, False)
        assert instance.held_prompts() == []  # both busy
        instance.give_slot(0)
        instance.give_slot(1)
        assert instance.held_prompts() == [(0, "c", 4), (1, "a", 1)]
        await close(instance)

    run(scenario)


def test_with_saved_prompts_requests_on_one_slot_run_in_turn_and_a_cancelled_wait_holds_nothing(
    tmp_path: Path,
) -> None:
    """The per-key tier's lock (pool/router.py): a request pinned to a busy slot waits for it as it would in
    llama-server's queue, finds the slot as the last request left it (its own key's conversation: reused),
    and one that gives up while waiting (a client gone) leaves the slot to the next."""

    async def scenario() -> None:
        pool, _ = make_pool(parallel=1, instance_queue=3, max_queue=0)
        instance = await ready_instance(pool.config, 1)
        instance.saved_prompts = SavedPrompts(tmp_path / "prompt-cache", budget_mb=10, min_tokens=256)
        instance.prompt_folder = tmp_path / "prompt-cache"
        pool.instances.append(instance)
        first, gone, next_turn = Lease(pool, "alice"), Lease(pool, "bob"), Lease(pool, "alice")
        for lease in (first, gone, next_turn):
            await lease.acquire()
        assert await first.pin(start=7, size=300) == (0, False)  # the slot held nothing known
        waiting = [asyncio.ensure_future(lease.pin(start, size=300)) for lease, start in ((gone, 9), (next_turn, 7))]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting)  # the slot is alice's first request's
        waiting[0].cancel()
        first.release()
        gone.release(finished=False)  # as the engine does for a request that ended; it never ran
        # alice's next turn: the slot holds her conversation (bob's request never ran), so it is reused.
        assert await waiting[1] == (0, True)
        next_turn.release()
        assert not instance.slot_gate(0).busy and instance.slot_holds(0) == ("alice", 7, 300)
        await close(instance)

    run(scenario)


async def heavy_streams() -> tuple[ModelPool, Instance, dict[str, Turn], list[str]]:
    """A pool of one instance (2 slots, 2 queue places, fair_slice 0.3 s) whose places one key's streams
    hold: two running, two queued in llama-server; the names of those asked to give their place back."""
    pool, _ = make_pool(max_queue=8, parallel=2, instance_queue=2)
    pool.fair_slice = 0.3
    instance = await ready_instance(pool.config, 1)
    pool.instances.append(instance)
    asked: list[str] = []
    turns = {}
    for name, running in (("run1", True), ("run2", True), ("queued1", False), ("queued2", False)):
        assert await pool.acquire("heavy") is instance
        turns[name] = Turn("heavy", lambda name=name: asked.append(name), running)
        pool.offer(turns[name])
    return pool, instance, turns, asked


def test_a_key_below_its_share_gets_a_slot_given_back_within_the_slice() -> None:
    """Fair shares bounded in time (pool/pool.py): one key's streams hold both slots and both places in
    the instance's queue. Alone, it keeps them all. When another key's request comes, the streams still
    queued in llama-server give their places back at once, a running one only once it has run
    `fair_slice` seconds; the waiting key takes a free slot, never a queue place behind the generations."""

    async def scenario() -> None:
        pool, instance, turns, asked = await heavy_streams()
        own = asyncio.create_task(pool.acquire("heavy"))  # the same key waiting: nothing given back
        await asyncio.sleep(0)
        assert asked == [] and not own.done()

        light = asyncio.create_task(pool.acquire("light"))
        await asyncio.sleep(0)
        assert sorted(asked) == ["queued1", "queued2"]  # they lose nothing: at once
        for name in asked:
            pool.withdraw(turns[name])  # they stop (as a lease's release does), and would wait again (resumed)
            pool.release(instance, "heavy")
        await asyncio.sleep(0)
        assert not light.done()  # a free place in the instance's queue, not a slot: it waits
        assert await wait_until(lambda: len(asked) == 3, 5)
        assert asked[2] in ("run1", "run2") and pool.yields == 3
        pool.withdraw(turns[asked[2]])
        pool.release(instance, "heavy")
        assert await light is instance  # the slot given back
        # The heavy key's own new request may queue in the instance behind its own generation; the ones that
        # gave their places back wait for a free slot (engine/generation.py sends them with resumed=True).
        assert await own is instance and instance.load == 3
        resumed = asyncio.create_task(pool.acquire("heavy", resumed=True))
        await asyncio.sleep(0)
        assert not resumed.done()
        pool.release(instance, "light")
        await asyncio.sleep(0)
        assert not resumed.done()  # two requests on two slots (one in fact queued): still no free slot
        pool.release(instance, "heavy")
        assert await resumed is instance
        for _ in range(2):
            pool.release(instance, "heavy")
        assert instance.load == 0
        await close(instance)

    run(scenario)


def test_fair_slice_zero_keeps_every_slot_to_its_end() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(max_queue=8, parallel=1)
        pool.fair_slice = 0.0
        instance = await ready_instance(pool.config, 1)
        pool.instances.append(instance)
        asked: list[str] = []
        await pool.acquire("heavy")
        pool.offer(Turn("heavy", lambda: asked.append("heavy"), running=True, since=0.0))
        light = asyncio.create_task(pool.acquire("light"))
        await asyncio.sleep(0.05)
        assert asked == [] and not light.done() and pool.yields == 0
        pool.release(instance, "heavy")
        assert await light is instance
        pool.release(instance, "light")
        await close(instance)

    run(scenario)


def test_a_gateway_above_its_share_gives_slots_back_within_the_slice_while_another_gateway_waits() -> None:
    """Between gateways that share a node's instance (cluster/sharing.py fills `gateways_elsewhere`): this
    gateway's streams hold both slots and both queue places; another gateway has a request waiting and holds
    nothing. The streams queued in llama-server give their places back at once, one running stream after
    `fair_slice` (the share: 2 slots ÷ 2 gateways), and this gateway takes no place back meanwhile."""

    async def scenario() -> None:
        pool, instance, turns, asked = await heavy_streams()
        pool.rebalance()
        assert asked == []  # alone: it keeps every place
        pool.gateways_elsewhere = [(0, 1)]  # the other gateway's request waits (its load, heard)
        pool.rebalance()
        assert sorted(asked) == ["queued1", "queued2"]  # at once: they lose nothing
        own = asyncio.create_task(pool.acquire("heavy", resumed=True))  # one of them waits again
        for name in list(asked):
            pool.withdraw(turns[name])
            pool.release(instance, "heavy")
        await asyncio.sleep(0)
        assert not own.done()  # a free place, but it is the other gateway's turn
        assert await wait_until(lambda: len(asked) == 3, 5)
        assert asked[2] in ("run1", "run2")
        pool.withdraw(turns[asked[2]])
        pool.release(instance, "heavy")  # a slot free, for the other gateway
        await asyncio.sleep(0)
        assert not own.done() and instance.load == 1
        pool.gateways_elsewhere = [(1, 0)]  # it took the slot: nobody waits elsewhere now
        pool.dispatch()
        assert await own is instance
        for _ in range(2):
            pool.release(instance, "heavy")
        await close(instance)

    run(scenario)


def test_a_gateway_below_its_share_takes_free_slots_only_while_another_is_above_its_own() -> None:
    async def scenario() -> None:
        pool, _ = make_pool(max_queue=8, parallel=2, instance_queue=2)
        pool.fair_slice = 0.3
        instance = await ready_instance(pool.config, 1)
        pool.instances.append(instance)
        instance.elsewhere = 2  # the other gateway's streams hold both slots ...
        pool.gateways_elsewhere = [(2, 0)]
        waiting = asyncio.create_task(pool.acquire("light"))
        await asyncio.sleep(0)
        assert not waiting.done()  # ... and a place in the instance's queue would wait behind them
        instance.elsewhere = 1  # one given back
        pool.gateways_elsewhere = [(1, 0)]
        pool.dispatch()
        assert await waiting is instance
        pool.release(instance, "light")
        await close(instance)

    run(scenario)


async def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
