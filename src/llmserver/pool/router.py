"""Routing: a request's slot on an instance of its model, as a lease it holds until it is done.

The router only finds pools and hands out leases. An instance that a request could not reach is
reported to its pool, whose owner (the supervisor) decides what that means.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from llmserver.errors import ModelNotFound
from llmserver.llama.client import LlamaServerClient
from llmserver.pool.instance import Instance
from llmserver.pool.pool import ModelPool, Turn


class Lease:
    """One request's slot on an instance of one model: taken, perhaps replaced once, released."""

    def __init__(
        self, pool: ModelPool, key_id: str, affinity: str | None = None, keep_alive: float | None = None
    ) -> None:
        self.pool = pool
        self.key_id = key_id
        self.affinity = affinity  # the prompt-cache affinity key (pool/affinity.py)
        self.keep_alive = keep_alive  # seconds its instance is kept from idling out after this request
        self.instance: Instance | None = None
        self.failed_on: Instance | None = None  # the instance its last attempt failed on
        self.slot: int | None = None  # the slot its call is pinned to (cache_isolation = "key")
        self.start = 0  # a hash of how its prompt begins: which of its key's conversations it is
        self.size = 0  # its prompt's length in bytes
        self.waits = False  # it waits for its turn on its slot (saved prompts on) ...
        self.entered = False  # ... has it ...
        self.alone = False  # ... and has the slot to itself
        self.turn: Turn | None = None  # while it may be asked to give its slot back (pool/pool.py)
        self.hold: str | None = None  # its hold on a slot of an instance other gateways share (cluster/slots.py)
        self.freeing: asyncio.Task[None] | None = None  # that slot given back, until every gateway sees it
        self.grammar = False  # its call carries a grammar (a JSON schema, tools): the watchdog's suspect

    async def acquire(self, resumed: bool = False) -> Instance:
        """Wait in the model's queue for a slot (503 when the queue is full, 504 past queue_timeout);
        `resumed`: again, after it gave its slot back (first among its key's requests, no timeout)."""
        assert self.instance is None, "a lease holds one slot at a time"
        self.instance = await self.pool.acquire(self.key_id, self.affinity, self.failed_on, resumed)
        if self.keep_alive is not None:
            self.instance.keep_until = max(self.instance.keep_until, time.time() + self.keep_alive)
        return self.instance

    @property
    def client(self) -> LlamaServerClient | None:
        """The client of the instance it holds a slot on (None: none, or the instance went away)."""
        return self.instance.client if self.instance is not None else None

    def yields(self, stop: Callable[[], None], running: bool) -> None:
        """It can give its slot back: `stop` ends its call to the instance; `running`: llama-server began
        it (else it still waits in llama-server's queue)."""
        turn = self.turn
        if turn is None or turn.asked:
            turn = self.turn = Turn(self.key_id, stop, running)
        else:
            turn.stop = stop
            if running and not turn.running:
                turn.running, turn.since = True, time.monotonic()
        self.pool.offer(turn)

    def keeps(self) -> None:
        """It can no longer give its slot back (its answer turned to what a continuation cannot redo)."""
        if self.turn is not None:
            self.pool.withdraw(self.turn)
            self.turn = None

    def carries_grammar(self) -> None:
        """Its call to the instance carries a grammar: should the instance stall, its key is the one blamed
        (a grammar is what holds llama-server's main loop; the other keys' requests are sent again)."""
        if self.instance is not None and not self.grammar:
            self.grammar = True
            self.instance.grammars[self.key_id] = self.instance.grammars.get(self.key_id, 0) + 1
            if self.instance.shared:
                self.pool.on_load()  # a node's watchdog learns it with this gateway's load

    def _grammar_done(self, instance: Instance) -> None:
        if self.grammar:
            self.grammar = False
            left = instance.grammars.pop(self.key_id, 0) - 1
            if left > 0:
                instance.grammars[self.key_id] = left
            instance.last_grammar = (self.key_id, time.monotonic())

    def answered(self) -> None:
        """Its instance answered: proof enough that it is alive (the supervisor skips its next probe)."""
        if self.instance is not None:
            self.instance.answered_at = time.monotonic()

    def release(self, finished: bool = True) -> None:
        """Give the slot back; `finished`: the request ended normally (else its slot may still be
        working for a moment: llama-server notices a closed connection only at its next check)."""
        if self.turn is not None:
            self.keeps()
        if self.instance is not None:
            instance, self.instance = self.instance, None
            self._unpin(instance, finished)
            self._grammar_done(instance)
            instance.failures = 0  # it was reached
            self.pool.release(instance, self.key_id)

    def failed(self) -> None:
        """The instance could not be reached: report it to its pool, give the slot back."""
        self.keeps()
        if self.instance is not None:
            instance, self.instance = self.instance, None
            self._unpin(instance, finished=False)
            self._grammar_done(instance)
            self.failed_on = instance
            instance.failures += 1
            self.pool.report_failure(instance)
            self.pool.release(instance, self.key_id)

    async def pin(self, start: int, size: int = 0) -> tuple[int, bool] | None:
        """Pin this request (its prompt's start hashed as `start`, its prompt `size` bytes long) to a slot
        of its instance: the slot and whether the request may reuse the slot's cached prompt (only its own
        key's); None when it may reuse nothing (an instance other gateways also use, while the record of its
        slots they share cannot be read: cluster/slots.py).

        With saved prompts on, this is the per-key tier under the slots: the request waits for its turn on
        the slot as it would in llama-server's queue (pool/slot_gate.py), then saves the conversation the
        slot holds if it is another one (another key's, or another of this key's) long enough to be worth
        it, and loads this conversation's saved cache if there is one. So under cache_isolation = "key" a
        conversation whose slot was taken in between is restored, not read again."""
        instance = self.instance
        if instance is None:
            return None
        if self.slot is not None:
            self._unpin(instance, finished=False)
        self.start, self.size = start, size
        if instance.shared:  # the same, through the record every gateway shares (cluster/slots.py)
            claimed = await instance.claim_slot(self.key_id, start, size)
            if claimed is None:
                return None
            self.slot, reuse, self.hold = claimed
            return self.slot, reuse
        saved = instance.saved_prompts
        if saved is None or not saved.enabled or instance.prompt_folder is None:
            self.slot, reuse, _ = instance.take_slot(self.key_id, start)
            if delay := instance.order_wait(self.slot, self.key_id):
                await asyncio.sleep(delay)  # sent after another key's request told to reuse the slot
            return self.slot, reuse
        if (idle := instance.idle_slot(size >= saved.min_tokens)) is not None:
            await idle  # whichever slot frees first, as llama-server's queue would hand it
        self.slot, reuse, _ = instance.take_slot(self.key_id, start)
        gate, mine, least = instance.slot_gate(self.slot), (self.key_id, start), saved.min_tokens

        def worth_saving(held: tuple[str, int, int] | None) -> bool:
            # A prompt of fewer bytes than min_tokens holds fewer tokens (a token is a byte or more, the
            # template's few aside): read again about as fast as it would be restored, so not saved.
            return held is not None and held[2] >= least and held[:2] != mine

        # A short prompt shares the slot (reusing its cache as without the tier), unless the slot holds a
        # conversation to save first (pool/slot_gate.py).
        self.alone = size >= least or worth_saving(instance.slot_holds(self.slot))
        self.waits = True
        waited = not gate.try_enter(self.alone)
        if waited:
            await gate.enter(self.alone)
        self.entered = True
        if not self.alone:
            # What the slot holds changes only while this request waited for its turn.
            if not waited or not worth_saving(instance.slot_holds(self.slot)):
                if delay := instance.order_wait(self.slot, self.key_id):
                    await asyncio.sleep(delay)  # sharing the slot: in order as above; alone, by its turn
                return self.slot, reuse  # take_slot's rule: the slot's requests since idle all this key's
            gate.leave(False)  # a conversation worth keeping came to the slot meanwhile: saved, alone
            self.entered, self.alone = False, True
            await gate.enter(True)
            self.entered = True
        held = instance.slot_holds(self.slot)
        if held is not None and held[:2] == mine:
            return self.slot, True
        if worth_saving(held):
            assert held is not None
            await saved.keep(instance, self.slot, held[0], held[1])
        reuse = held is not None and held[0] == self.key_id
        if saved.has(instance, *mine):
            reuse = await saved.restore(instance, self.slot, *mine) or reuse
        return self.slot, reuse

    async def freed(self, within: float) -> None:
        """Wait (at most `within` seconds) until the slot it gave back on an instance other gateways share
        is free in their eyes too (cluster/slots.py), so that its key's next turn, through any of them,
        finds its conversation's slot idle."""
        if self.freeing is not None and not self.freeing.done():
            await asyncio.wait([self.freeing], timeout=within)

    def _unpin(self, instance: Instance, finished: bool) -> None:
        if self.hold is not None and self.slot is not None:
            self.freeing = instance.free_slot(self.slot, self.hold, finished, (self.key_id, self.start, self.size))
            self.slot = self.hold = None
        elif self.slot is not None:
            # A request that gave up waiting for its turn on the slot never ran there.
            ran = self.entered or not self.waits
            instance.give_slot(self.slot, finished, (self.key_id, self.start, self.size), ran=ran)
            if self.entered:
                instance.slot_gate(self.slot).leave(self.alone)
            self.slot, self.entered, self.waits = None, False, False


class Router:
    def __init__(self, pools: Mapping[str, ModelPool]) -> None:
        self._pools = pools

    def pool(self, model: str) -> ModelPool:
        try:
            return self._pools[model]
        except KeyError:
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model") from None

    def lease(self, model: str, key_id: str, affinity: str | None = None, keep_alive: float | None = None) -> Lease:
        return Lease(self.pool(model), key_id, affinity, keep_alive)
