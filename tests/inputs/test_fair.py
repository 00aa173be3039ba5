"""Extraction slots shared fairly between keys."""

from __future__ import annotations

import asyncio

from llmserver.inputs.fair import FairSlots


def test_a_waiting_key_goes_before_a_key_that_already_holds_a_slot() -> None:
    async def scenario() -> list[str]:
        slots = FairSlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def work(owner: str, hold: bool = False) -> None:
            async with slots.slot(owner):
                order.append(owner)
                if hold:
                    await release.wait()

        first = asyncio.create_task(work("a", hold=True))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(work(owner)) for owner in ("a", "a", "a", "b")]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *queued)
        assert slots.free == 1 and not slots.held
        return order

    order = asyncio.run(scenario())
    # b arrived last but holds nothing: it goes right after a's first file, not after all of a's
    assert order[:2] == ["a", "b"] and order.count("a") == 4


def test_a_cancelled_waiter_leaks_no_slot() -> None:
    async def scenario() -> FairSlots:
        slots = FairSlots(1)
        async with slots.slot("a"):
            waiting = asyncio.create_task(slots.slot("b").__aenter__())
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        return slots

    slots = asyncio.run(scenario())
    assert slots.free == 1 and not slots.held
