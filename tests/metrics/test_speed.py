from __future__ import annotations

import asyncio
from pathlib import Path

from llmserver.metrics.speed import RollingSpeed
from llmserver.store import UsageBatch
from llmserver.store.sqlite import SQLiteStore


class Clock:
    now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_thirty_day_window_persisted(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock()
        store = SQLiteStore(tmp_path / "s.db")
        speed = RollingSpeed(store, clock)
        await speed.load()
        assert speed.average("m") is None
        for tokens, seconds, later in ((100, 2.0, 3600), (50, 3.0, 0), (0, 1.0, 0)):
            increment = speed.add("m", tokens, seconds)
            if increment is not None:  # the recorder persists it (batched)
                await store.record(UsageBatch(speeds=[increment]))
            clock.now += later
        assert speed.add("m", 0, 1.0) is None  # nothing generated: not counted
        assert speed.average("m") == 30.0
        restarted = RollingSpeed(store, clock)
        await restarted.load()
        assert restarted.average("m") == 30.0  # survives a restart
        clock.now += 30 * 24 * 3600 - 1800  # the first bucket is now older than 30 days
        assert speed.average("m") == round(50 / 3.0, 2)
        clock.now += 7200
        assert speed.average("m") is None
        await store.close()

    asyncio.run(scenario())


def test_a_batch_holds_one_increment_per_bucket_and_persists_the_same_speeds(tmp_path: Path) -> None:
    """The recorder queues each request's increment with `UsageBatch.add_speed`: one model's requests
    in one minute become one row of the batch (a busy gateway wrote one upsert a request), and what is
    read back after a restart is what was counted."""

    async def scenario() -> None:
        clock = Clock()
        store = SQLiteStore(tmp_path / "s.db")
        speed = RollingSpeed(store, clock)
        await speed.load()
        minute = int(clock.now // 60)
        batch = UsageBatch()
        for model, tokens, seconds, later in (("m", 10, 1.0, 0), ("m", 20, 1.0, 0), ("n", 5, 1.0, 0), ("n", 5, 1.0, 60),
                                              ("n", 6, 2.0, 0), ("m", 4, 2.0, 0)):  # fmt: skip
            increment = speed.add(model, tokens, seconds)
            assert increment is not None
            batch.add_speed(increment)
            clock.now += later
        assert batch.speeds == [
            ("m", minute, 30.0, 2.0), ("n", minute, 10.0, 2.0), ("n", minute + 1, 6.0, 2.0), ("m", minute + 1, 4.0, 2.0)
        ]  # fmt: skip
        await store.record(batch)
        restarted = RollingSpeed(store, clock)
        await restarted.load()
        assert (restarted.average("m"), restarted.average("n")) == (speed.average("m"), speed.average("n")) == (
            round(34 / 4.0, 2), round(16 / 4.0, 2)
        )  # fmt: skip
        await store.close()

    asyncio.run(scenario())
