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
