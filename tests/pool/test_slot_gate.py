"""Turns on one slot (pool/slot_gate.py): short requests share it, a request that saves, restores or
reuses has it alone, first come first served, and one that gives up waiting holds nothing."""

from __future__ import annotations

import asyncio

from llmserver.pool.slot_gate import SlotGate


def test_short_requests_share_a_slot_and_one_that_goes_alone_waits_for_them_and_keeps_its_place() -> None:
    async def scenario() -> None:
        gate = SlotGate()
        await gate.enter(False)
        await gate.enter(False)  # two short ones at once: queued in llama-server, as without the tier
        alone = asyncio.ensure_future(gate.enter(True))
        later_short = asyncio.ensure_future(gate.enter(False))
        await asyncio.sleep(0)
        assert not alone.done() and not later_short.done()  # not overtaken by a short one that came after
        gate.leave(False)
        await asyncio.sleep(0)
        assert not alone.done()
        gate.leave(False)
        await asyncio.sleep(0)
        assert alone.done() and not later_short.done() and gate.alone
        gate.leave(True)
        await asyncio.sleep(0)
        assert later_short.done() and gate.sharing == 1
        gate.leave(False)
        assert not gate.busy

    asyncio.run(scenario())


def test_a_request_that_gives_up_waiting_leaves_its_turn_to_the_next() -> None:
    async def scenario() -> None:
        gate = SlotGate()
        await gate.enter(True)
        gone = asyncio.ensure_future(gate.enter(True))
        short = asyncio.ensure_future(gate.enter(False))
        await asyncio.sleep(0)
        gone.cancel()
        gate.leave(True)  # the slot's turn passes over the cancelled one at once
        await asyncio.sleep(0)
        assert gone.cancelled() and short.done() and gate.sharing == 1 and not gate.alone
        gate.leave(False)
        assert not gate.busy

    asyncio.run(scenario())
