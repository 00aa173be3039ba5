"""Slots shared fairly between owners (API keys): when slots are scarce, the next one goes to the
waiting owner that holds the fewest, then to the one served longest ago (round robin), first come
first served among equals. One key sending many heavy files then waits behind its own work, not in
front of everyone else's."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    order: int
    owner: str = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class FairSlots:
    def __init__(self, slots: int) -> None:
        self.free = slots
        self.held: collections.Counter[str] = collections.Counter()
        self._waiters: list[_Waiter] = []
        self._order = itertools.count()
        self._served: dict[str, int] = {}  # owner → when it was last granted a slot
        self._grants = itertools.count()

    @asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        await self._acquire(owner)
        try:
            yield
        finally:
            self._release(owner)

    async def _acquire(self, owner: str) -> None:
        if self.free > 0 and not self._waiters:
            self._take(owner)
            return
        waiter = _Waiter(next(self._order), owner, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self._release(owner)  # granted just as it gave up
            raise

    def _take(self, owner: str) -> None:
        self.free -= 1
        self.held[owner] += 1
        self._served[owner] = next(self._grants)

    def _release(self, owner: str) -> None:
        self.free += 1
        self.held[owner] -= 1
        if self.held[owner] <= 0:
            del self.held[owner]
            if not any(w.owner == owner for w in self._waiters):
                self._served.pop(owner, None)  # bounded: only owners holding or waiting are remembered
        self._grant()

    def _grant(self) -> None:
        while self.free > 0 and self._waiters:
            waiter = min(self._waiters, key=lambda w: (self.held[w.owner], self._served.get(w.owner, -1), w.order))
            self._waiters.remove(waiter)
            if waiter.future.done():
                continue
            self._take(waiter.owner)
            waiter.future.set_result(None)
