"""Quota windows, reservations, adjustments, settlements and the sweep of a dead gateway's reservations,
on each engine (a real SQLite file, a real PostgreSQL database), with an injectable clock."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from llmserver.auth.keys import Principal
from llmserver.auth.quota import InsufficientQuota, QuotaService, Reservation, window
from llmserver.store import KeyLimits, Store, TeamRecord, UsageBatch
from tests.support import with_store


class Clock:
    def __init__(self, moment: datetime) -> None:
        self.now = moment.timestamp()

    def __call__(self) -> float:
        return self.now


def principal(**limits: object) -> Principal:
    return Principal("key_q", "q", "qqqqqqqq", False, KeyLimits(**limits))  # type: ignore[arg-type]


async def settle(store: Store, quota: QuotaService, reservations: list[Reservation], used: int) -> None:
    """What the usage recorder does when a request closes: the settlements, written with the ledger."""
    await store.record(UsageBatch(settlements=quota.settlements(reservations, used)))


def test_windows() -> None:
    at = datetime(2026, 1, 31, 23, 59, 30, tzinfo=UTC).timestamp()
    day, month, total = window("day", at), window("month", at), window("total", at)
    assert (day.start, day.resets_at) == ("2026-01-31", datetime(2026, 2, 1, tzinfo=UTC))
    assert (month.start, month.resets_at) == ("2026-01", datetime(2026, 2, 1, tzinfo=UTC))
    assert (total.start, total.resets_at) == ("total", None)
    assert window("month", datetime(2026, 12, 5, tzinfo=UTC).timestamp()).resets_at == datetime(2027, 1, 1, tzinfo=UTC)


def test_reserve_settle_and_day_rollover(database_url: str) -> None:
    async def test(store: Store) -> None:
        clock = Clock(datetime(2026, 3, 1, 23, 59, tzinfo=UTC))
        quota = QuotaService(store, "gw1", clock)
        who = principal(quota_tokens=100, quota_period="day")
        first = await quota.reserve(who, 60)
        with pytest.raises(InsufficientQuota) as caught:
            await quota.reserve(who, 50)  # 60 reserved + 50 > 100, whatever the first one will really use
        assert caught.value.status == 429 and "2026-03-02T00:00:00+00:00" in caught.value.message
        assert "may use up to 50 tokens and 40 are left" in caught.value.message
        # What blocks it is the first request's hold, not what was used: a retry may succeed once it ends.
        assert "60 of them are held by this key's requests in flight" in caught.value.message
        assert caught.value.headers["Retry-After"] == "1"
        await settle(store, quota, first, 30)  # the real count: 30 charged, 30 released
        await settle(store, quota, first, 30)  # settling twice changes nothing
        assert (await quota.headers(who))["x-ratelimit-remaining-tokens"] == "70"
        await quota.reserve(who, 70)
        with pytest.raises(InsufficientQuota):
            await quota.reserve(who, 1)
        clock.now += 120  # a new UTC day: a fresh window
        assert await quota.reserve(who, 100)
        assert await quota.headers(who) == {
            "x-ratelimit-limit-tokens": "100",
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": f"{24 * 3600 - 60}s",
        }

    with_store(database_url, test)


def test_adjust_shrinks_or_grows_within_what_is_left(database_url: str) -> None:
    async def test(store: Store) -> None:
        quota = QuotaService(store, "gw1", Clock(datetime(2026, 3, 1, tzinfo=UTC)))
        who = principal(quota_tokens=100, quota_period="month")
        held = await quota.reserve(who, 80)
        await quota.adjust(held, 30)  # the inputs turned out smaller than their bound
        assert [r.amount for r in held] == [30]
        other = await quota.reserve(who, 60)
        with pytest.raises(InsufficientQuota) as caught:
            await quota.adjust(held, 41)  # 60 + 41 > 100
        assert "may use up to 41 tokens and 40 are left" in caught.value.message
        assert [r.amount for r in held] == [30]  # a refused growth changes nothing
        await quota.adjust(held, 40)  # exactly what is left
        assert (await quota.headers(who))["x-ratelimit-remaining-tokens"] == "0"
        await settle(store, quota, other, 0)
        await settle(store, quota, held, 25)
        assert (await quota.headers(who))["x-ratelimit-remaining-tokens"] == "75"

    with_store(database_url, test)


def test_a_sweep_charges_only_that_gateways_reservations_at_what_they_produced(database_url: str) -> None:
    async def test(store: Store) -> None:
        clock = Clock(datetime(2026, 3, 1, tzinfo=UTC))
        mine, theirs = QuotaService(store, "gw1", clock), QuotaService(store, "gw2", clock)
        who = principal(quota_tokens=100, quota_period="total")
        await mine.reserve(who, 30)
        await theirs.reserve(who, 50)
        await store.quota_progress("gw1", {("key_q", "total"): 12})  # gw1's requests had produced 12 tokens
        await store.quota_progress("gw2", {("key_q", "total"): 99})  # capped at what gw2 reserved
        swept = await store.sweep_gateway("gw1", error="{}", expires_at=0.0, only_if_lapsed=False)
        assert swept is not None and (swept.reservations, swept.charged) == (1, 12)
        # 12 used, gw2's 50 still held
        assert (await mine.headers(who))["x-ratelimit-remaining-tokens"] == "38"
        assert await store.quota_counts("key_q", "total") == (12, 50)
        swept = await store.sweep_gateway("gw2", error="{}", expires_at=0.0, only_if_lapsed=False)
        assert swept is not None and swept.charged == 50
        assert await store.quota_counts("key_q", "total") == (62, 0)

    with_store(database_url, test)


def test_total_quota_never_resets_and_keys_without_quota(database_url: str) -> None:
    async def test(store: Store) -> None:
        quota = QuotaService(store, "gw1", Clock(datetime(2026, 3, 1, tzinfo=UTC)))
        who = principal(quota_tokens=10, quota_period="total")
        await settle(store, quota, await quota.reserve(who, 10), 10)
        with pytest.raises(InsufficientQuota) as caught:
            await quota.reserve(who, 1)
        assert "does not reset" in caught.value.message and "Retry-After" not in caught.value.headers
        # A total quota blocked by a hold says when to retry, never "does not reset" (issue 39, row 6).
        other = Principal("key_t2", "t2", "tttttttt", False, KeyLimits(quota_tokens=100, quota_period="total"))
        held = await quota.reserve(other, 90)
        with pytest.raises(InsufficientQuota) as caught:
            await quota.reserve(other, 20)
        assert "does not reset" not in caught.value.message and "retry when one has finished" in caught.value.message
        assert caught.value.headers["Retry-After"] == "1"
        await settle(store, quota, held, 12)
        await quota.reserve(other, 20)
        assert await quota.reserve(principal(), 10**9) == [] and await quota.headers(principal()) == {}

    with_store(database_url, test)


def test_a_keys_standing_counts_what_is_used_and_held_and_says_when_it_resets(database_url: str) -> None:
    async def test(store: Store) -> None:
        clock = Clock(datetime(2026, 3, 1, 23, 59, tzinfo=UTC))
        quota = QuotaService(store, "gw1", clock)
        who = principal(quota_tokens=100, quota_period="day")
        assert await quota.standing(who.key_id, KeyLimits()) is None  # no quota, nothing to show
        assert await quota.standing(who.key_id, who.limits) == {
            "limit": 100, "period": "day", "window": "2026-03-01", "used": 0, "reserved": 0, "left": 100,
            "resets_at": "2026-03-02T00:00:00+00:00",
        }  # fmt: skip
        done = await quota.reserve(who, 30)
        await settle(store, quota, done, 25)
        await quota.reserve(who, 40)  # in flight
        standing = await quota.standing(who.key_id, who.limits)
        assert standing is not None and (standing["used"], standing["reserved"], standing["left"]) == (25, 40, 35)
        clock.now += 120  # the next UTC day: a new window
        standing = await quota.standing(who.key_id, who.limits)
        assert standing is not None and (standing["window"], standing["used"], standing["left"]) == (
            "2026-03-02",
            0,
            100,
        )
        total = await quota.standing(who.key_id, KeyLimits(quota_tokens=5, quota_period="total"))
        assert total is not None and total["resets_at"] is None

    with_store(database_url, test)


def test_a_teams_quota_holds_for_its_keys_together_and_each_key_within_its_own(database_url: str) -> None:
    async def test(store: Store) -> None:
        quota = QuotaService(store, "gw1", Clock(datetime(2026, 3, 1, tzinfo=UTC)))
        team = TeamRecord("team_r", "research", "2026-03-01", KeyLimits(quota_tokens=100, quota_period="day"))
        alice = Principal(
            "key_a", "alice", "aaaaaaaa", False, KeyLimits(quota_tokens=70, quota_period="month"), team=team
        )
        bob = Principal("key_b", "bob", "bbbbbbbb", False, team=team)  # no quota of its own: the team's
        held = await quota.reserve(alice, 60)
        assert [(r.key_id, r.amount) for r in held] == [("key_a", 60), ("team_r", 60)]
        with pytest.raises(InsufficientQuota) as caught:
            await quota.reserve(bob, 41)  # 60 + 41 > the team's 100
        assert "team 'research' (100 per day)" in caught.value.message and "40 are left" in caught.value.message
        with pytest.raises(InsufficientQuota) as caught:
            await quota.reserve(alice, 11)  # the team has 40 left, alice's own quota 10
        assert caught.value.message.startswith("This API key's token quota (70 per month)")
        # A refusal by the team leaves nothing held on the key's own counter.
        roomy = Principal(
            "key_a", "alice", "aaaaaaaa", False, KeyLimits(quota_tokens=1000, quota_period="month"), team=team
        )
        with pytest.raises(InsufficientQuota):
            await quota.reserve(roomy, 41)  # its own counter would grant it; the team's refuses
        assert await store.quota_counts("key_a", "2026-03") == (0, 60)
        assert await store.quota_counts("team_r", "2026-03-01") == (0, 60)
        # Settled: both counters charged what was used, the rest given back.
        await settle(store, quota, held, 25)
        assert await store.quota_counts("key_a", "2026-03") == (25, 0)
        assert await store.quota_counts("team_r", "2026-03-01") == (25, 0)
        second = await quota.reserve(bob, 75)
        assert [r.key_id for r in second] == ["team_r"]
        with pytest.raises(InsufficientQuota):
            await quota.exhausted(alice)  # the team's day is spent, though alice's month is not
        standing = await quota.standing(team.id, team.limits)
        assert standing is not None and (standing["used"], standing["reserved"], standing["left"]) == (25, 75, 0)

    with_store(database_url, test)


def test_a_budget_in_money_holds_what_a_request_may_cost_and_its_thresholds_are_crossed_once(
    database_url: str,
) -> None:
    """At 1,000 per million tokens (0.001 a token) a 0.1 budget holds 100 tokens' worth; each settlement is
    charged the request's real cost, and each threshold is reported by the one settlement that crosses
    it, whichever of two gateways writes it."""

    async def test(store: Store) -> None:
        clock = Clock(datetime(2026, 3, 1, tzinfo=UTC))
        mine = QuotaService(store, "gw1", clock, currency="EUR", thresholds=(50, 80, 100))
        theirs = QuotaService(store, "gw2", clock, currency="EUR", thresholds=(50, 80, 100))
        who = principal(budget=0.1, budget_period="day")
        assert await mine.reserve(who, 10**6) == []  # a model without prices costs nothing
        held = await mine.reserve(who, 60, price=(1000.0, 1000.0))
        assert [(r.key_id, r.amount) for r in held] == [("key_q/money", 60_000_000)]
        with pytest.raises(InsufficientQuota) as caught:
            await theirs.reserve(who, 50, price=(1000.0, 1000.0))
        assert caught.value.message.startswith(
            "This API key's budget (0.1 EUR per day) cannot cover this request: it may cost up to 0.050000 EUR and "
            "0.040000 are left; 0.060000 EUR of them are held by this key's requests in flight"
        )
        crossed = []
        for service, reservation, cost in [(mine, held, 0.03), (theirs, None, 0.03), (mine, None, 0.021)]:
            taken = reservation or await service.reserve(who, 30, price=(1000.0, 1000.0))
            crossed += await store.record(UsageBatch(settlements=service.settlements(taken, 30, cost)))
        assert [(a.owner, a.threshold) for a in crossed] == [("key", 50), ("key", 80)]  # 0.03, 0.06, 0.081
        standing = await mine.budget_standing("key_q", who.limits)
        assert standing is not None and (standing["spent"], standing["reserved"], standing["currency"]) == (
            0.081,
            0.0,
            "EUR",
        )
        last = await theirs.reserve(who, 19, price=(1000.0, 1000.0))
        crossed = await store.record(UsageBatch(settlements=theirs.settlements(last, 19, 0.019)))
        assert [a.threshold for a in crossed] == [100] and json.loads(crossed[0].payload)["window"] == "2026-03-01"
        with pytest.raises(InsufficientQuota):
            await mine.reserve(who, 1, price=(1000.0, 1000.0))

    with_store(database_url, test)


def test_a_budget_prices_the_prompt_bound_at_the_input_price_and_max_tokens_at_the_output_price(
    database_url: str,
) -> None:
    async def test(store: Store) -> None:
        quota = QuotaService(store, "gw1", Clock(datetime(2026, 3, 1, tzinfo=UTC)))
        who = principal(budget=1.0, budget_period="month")
        # 100 tokens, 20 of them max_tokens: 80 at 500 and 20 at 1,500 per million (not 100 at the dearest).
        (held,) = await quota.reserve(who, 100, price=(500.0, 1500.0), completion=20)
        assert held.amount == 80 * 500_000 + 20 * 1_500_000
        await quota.adjust([held], 50)  # the real prompt: 30 tokens, the same 20 of completion
        assert held.amount == 30 * 500_000 + 20 * 1_500_000

    with_store(database_url, test)
