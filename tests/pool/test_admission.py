"""Admission's order and what a refusal leaves behind: a real SQLite store, the in-process limiters,
and a model pool whose instance has no process behind it (nothing is sent anywhere)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from llmserver.auth.keys import Principal
from llmserver.auth.quota import InsufficientQuota
from llmserver.errors import Overloaded, RateLimited, StateUnavailable
from llmserver.pool.admission import outcome_of
from llmserver.store import KeyLimits
from tests.support.pool import World, world


def run(tmp_path: Path, test: Callable[[World], Awaitable[None]], **options: int) -> None:
    async def scenario() -> None:
        async with world(tmp_path, **options) as w:
            await test(w)

    asyncio.run(scenario())


def key(name: str = "k", **limits: object) -> Principal:
    return Principal(f"key_{name}", name, "ffffffff", False, KeyLimits(**limits))  # type: ignore[arg-type]


def test_rpm_comes_before_everything_and_takes_nothing(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        who = key(rpm=1, quota_tokens=100, quota_period="total")
        ticket = await w.admission.admit(who, "/x", "m", 10)
        ticket.close("ok")
        with pytest.raises(RateLimited) as caught:
            await w.admission.admit(who, "/x", "m", 10)
        assert caught.value.headers["Retry-After"] == "60"
        assert await w.places.held(who.key_id) == 0
        assert await w.remaining(who) == 100  # the refused request reserved nothing; the first used 0
        assert w.rejections("rate_limit_error") == 1

    run(tmp_path, test)


def test_concurrency_comes_before_the_quota(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        who = key(max_concurrency=1, quota_tokens=100, quota_period="total")
        first = await w.admission.admit(who, "/x", "m", 60)
        with pytest.raises(RateLimited) as caught:
            await w.admission.admit(who, "/x", "m", 60)  # the quota would refuse it too: concurrency says first
        assert "1 request in flight" in caught.value.message
        first.close("ok")
        second = await w.admission.admit(who, "/x", "m", 60)  # its place and reservation came back
        second.close("ok")

    run(tmp_path, test)


def test_a_quota_refusal_gives_the_place_in_flight_back(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        who = key(quota_tokens=50, quota_period="total")
        with pytest.raises(InsufficientQuota):
            await w.admission.admit(who, "/x", "m", 51)
        assert await w.places.held(who.key_id) == 0
        assert await w.remaining(who) == 50
        assert w.rejections("insufficient_quota") == 1

    run(tmp_path, test)


def test_the_queue_lease_comes_last_and_a_full_queue_gives_everything_back(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        alice, bob, carol = (key(n, quota_tokens=100, quota_period="total") for n in ("a", "b", "c"))
        running = await w.admission.admit(alice, "/x", "m", 10)
        await w.admission.take_slot(running)  # the only slot
        waiting = await w.admission.admit(bob, "/x", "m", 10)
        queued = asyncio.ensure_future(w.admission.take_slot(waiting))  # the only place in the queue
        await asyncio.sleep(0)
        refused = await w.admission.admit(carol, "/x", "m", 10)
        with pytest.raises(Overloaded):
            await w.admission.take_slot(refused)  # 503: the ticket is closed by the refusal
        assert await w.places.held(carol.key_id) == 0 and await w.remaining(carol) == 100
        running.close("ok")
        await queued  # the released slot went to the waiter
        assert waiting.tally.instance_id == running.tally.instance_id
        waiting.close("ok")
        await w.recorder.flush()
        rows = await w.store.usage_rows(None, 0, 2e9)
        assert sorted(str(r["outcome"]) for r in rows) == ["ok", "ok", "overloaded_error"]

    run(tmp_path, test)


def test_a_ticket_settles_what_was_used_once(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        who = key(quota_tokens=100, quota_period="total")
        ticket = await w.admission.admit(who, "/x", "m", 80)
        await w.admission.resize(ticket, 30)  # the inputs turned out smaller
        assert await w.remaining(who) == 70
        with pytest.raises(InsufficientQuota):
            await w.admission.resize(ticket, 101)  # grown past what is left: refused
        ticket.tally.prompt_tokens, ticket.tally.completion_tokens = 12, 8
        ticket.close("ok")
        ticket.close("server_error")  # a second close changes nothing
        assert await w.remaining(who) == 80
        assert await w.places.held(who.key_id) == 0
        rows = await w.store.usage_rows(who.key_id, 0, 2e9)
        assert [(r["outcome"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [("ok", 12, 8)]

    run(tmp_path, test)


def test_a_request_refused_for_unreachable_shared_state_is_no_ledger_row(tmp_path: Path) -> None:
    """A 503 because the database or Redis could not be read after admission (a quota resize) is not
    accepted, like one whose key could not be looked up: no row, its reservation released; one that had
    generated tokens is charged and recorded."""

    async def test(w: World) -> None:
        who = key(quota_tokens=100, quota_period="total")
        refused = await w.admission.admit(who, "/x", "m", 40)
        refused.close(outcome_of(StateUnavailable("The database cannot be reached; retry shortly.")))
        generated = await w.admission.admit(who, "/x", "m", 40)
        generated.tally.prompt_tokens, generated.tally.completion_tokens = 5, 3
        generated.close(outcome_of(StateUnavailable("The database cannot be reached; retry shortly.")))
        await w.recorder.flush()
        rows = await w.store.usage_rows(who.key_id, 0, 2e9)
        assert [(r["outcome"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
            ("overloaded_error", 5, 3)
        ]
        assert await w.remaining(who) == 92 and await w.places.held(who.key_id) == 0

    run(tmp_path, test)


def test_precheck_refuses_an_exhausted_key_without_counting_it(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        who = key(quota_tokens=10, quota_period="total", rpm=2)
        await w.admission.precheck(who)  # nothing used yet
        ticket = await w.admission.admit(who, "/x", "m", 10)
        ticket.tally.completion_tokens = 10
        ticket.close("ok")
        await w.recorder.flush()
        with pytest.raises(InsufficientQuota):
            await w.admission.precheck(who)
        assert await w.rate.wait(who.key_id, 2) is None  # one request counted, not two
        busy = key("busy", max_concurrency=1)
        held = await w.admission.admit(busy, "/x", "m", 1)
        with pytest.raises(RateLimited):
            await w.admission.precheck(busy)
        held.close("ok")
        await w.admission.precheck(busy)

    run(tmp_path, test)


def test_a_cancelled_request_is_recorded_as_client_closed() -> None:
    import asyncio

    from llmserver.pool.admission import outcome_of

    assert outcome_of(asyncio.CancelledError()) == "client_closed"  # the outcome the README lists
