"""Quota windows, reservations and rpm with an injectable clock (no waiting)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmserver.auth.keys import Principal
from llmserver.auth.quota import InsufficientQuota, QuotaService, window
from llmserver.errors import RateLimited
from llmserver.store import KeyLimits, SQLiteStore


class Clock:
    def __init__(self, moment: datetime) -> None:
        self.now = moment.timestamp()

    def __call__(self) -> float:
        return self.now


def principal(**limits: object) -> Principal:
    return Principal("key_q", "q", "qqqqqqqq", False, KeyLimits(**limits))  # type: ignore[arg-type]


def test_windows() -> None:
    at = datetime(2026, 1, 31, 23, 59, 30, tzinfo=UTC).timestamp()
    day, month, total = window("day", at), window("month", at), window("total", at)
    assert (day.start, day.resets_at) == ("2026-01-31", datetime(2026, 2, 1, tzinfo=UTC))
    assert (month.start, month.resets_at) == ("2026-01", datetime(2026, 2, 1, tzinfo=UTC))
    assert (total.start, total.resets_at) == ("total", None)
    assert window("month", datetime(2026, 12, 5, tzinfo=UTC).timestamp()).resets_at == datetime(2027, 1, 1, tzinfo=UTC)


def test_reserve_settle_and_day_rollover(tmp_path: Path) -> None:
    clock = Clock(datetime(2026, 3, 1, 23, 59, tzinfo=UTC))
    quota = QuotaService(SQLiteStore(tmp_path / "q.db"), clock)
    who = principal(quota_tokens=100, quota_period="day")
    first = quota.reserve(who, 60)
    with pytest.raises(InsufficientQuota) as caught:
        quota.reserve(who, 50)  # 60 reserved + 50 > 100, whatever the first one will really use
    assert caught.value.status == 429 and "2026-03-02T00:00:00+00:00" in caught.value.message
    assert caught.value.headers["Retry-After"] == "60"
    quota.settle(first, 30)  # the real count: 30 charged, 30 released
    quota.settle(first, 30)  # settling twice changes nothing
    assert quota.headers(who)["x-ratelimit-remaining-tokens"] == "70"
    quota.reserve(who, 70)
    with pytest.raises(InsufficientQuota):
        quota.reserve(who, 1)
    clock.now += 120  # a new UTC day: a fresh window
    assert quota.reserve(who, 100) is not None
    assert quota.headers(who) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": f"{24 * 3600 - 60}s",
    }


def test_total_quota_never_resets_and_keys_without_quota(tmp_path: Path) -> None:
    quota = QuotaService(SQLiteStore(tmp_path / "q.db"), Clock(datetime(2026, 3, 1, tzinfo=UTC)))
    who = principal(quota_tokens=10, quota_period="total")
    quota.settle(quota.reserve(who, 10), 10)
    with pytest.raises(InsufficientQuota) as caught:
        quota.reserve(who, 1)
    assert "does not reset" in caught.value.message and "Retry-After" not in caught.value.headers
    assert quota.reserve(principal(), 10**9) is None and quota.headers(principal()) == {}


def test_requests_per_minute(tmp_path: Path) -> None:
    clock = Clock(datetime(2026, 3, 1, tzinfo=UTC))
    quota = QuotaService(SQLiteStore(tmp_path / "q.db"), clock)
    who = principal(rpm=2)
    quota.check_rate(who)
    clock.now += 10
    quota.check_rate(who)
    with pytest.raises(RateLimited) as caught:
        quota.check_rate(who)
    assert caught.value.headers["Retry-After"] == "51"
    clock.now += 51
    quota.check_rate(who)
