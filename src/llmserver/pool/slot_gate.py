"""Who runs on one slot of an instance when saved prompts are on (the per-key tier under the slots).

A request that may reuse, save or restore the slot's cache goes **alone**: it waits until every request
before it on the slot has ended, so that what the slot holds is known exactly, and nothing runs there
between its save or restore and its own prompt. A short prompt (fewer bytes than `min_tokens`) leaves
nothing worth keeping, so such requests **share** the slot: several at once, queued in llama-server as
without the tier, each reusing the slot's cache only if every request pinned to the slot since it was
last idle is its own key's (`Instance.take_slot`) — tiny requests under 16 clients lost 8% of their
throughput when every request went alone. Turns are first come, first served: a request that must go
alone is not overtaken by short ones that came after it.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SlotGate:
    def __init__(self) -> None:
        self.sharing = 0  # short requests on the slot now
        self.alone = False  # one request has the slot to itself
        self._waiting: deque[tuple[bool, asyncio.Future[None]]] = deque()

    def _free(self, alone: bool) -> bool:
        return not self.alone and (self.sharing == 0 if alone else True)

    def _take(self, alone: bool) -> None:
        if alone:
            self.alone = True
        else:
            self.sharing += 1

    def try_enter(self, alone: bool) -> bool:
        """Take this request's turn on the slot (`alone`: to itself) if it is its turn now: nobody waits
        and the slot is free for it (`_free`, `_take`); False: `enter` waits for it. `leave` once it ended."""
        if not self._waiting and not self.alone and (not alone or self.sharing == 0):
            if alone:
                self.alone = True
            else:
                self.sharing += 1
            return True
        return False

    async def enter(self, alone: bool) -> None:
        """Wait for this request's turn on the slot (`alone`: to itself); `leave` once it has ended."""
        if self.try_enter(alone):
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((alone, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave(alone)  # its turn came as it gave up: handed on
            else:
                if (alone, turn) in self._waiting:
                    self._waiting.remove((alone, turn))
                self._wake()  # it may have held back those behind it
            raise

    def leave(self, alone: bool) -> None:
        if alone:
            self.alone = False
        else:
            self.sharing -= 1
        if self._waiting:
            self._wake()

    def _wake(self) -> None:
        while self._waiting and self._free(self._waiting[0][0]):
            alone, turn = self._waiting.popleft()
            if turn.done():  # given up (cancelled) and not yet out of the line
                continue
            self._take(alone)
            turn.set_result(None)

    @property
    def busy(self) -> bool:
        return self.alone or self.sharing > 0 or bool(self._waiting)
