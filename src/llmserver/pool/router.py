"""Routing: a request's slot on an instance of its model, as a lease it holds until it is done.

The router only finds pools and hands out leases. An instance that a request could not reach is
reported to its pool, whose owner (the supervisor) decides what that means.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from llmserver.errors import ModelNotFound
from llmserver.pool.instance import Instance
from llmserver.pool.pool import ModelPool


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

    async def acquire(self) -> Instance:
        """Wait in the model's queue for a slot (503 when the queue is full, 504 past queue_timeout)."""
        assert self.instance is None, "a lease holds one slot at a time"
        self.instance = await self.pool.acquire(self.key_id, self.affinity, self.failed_on)
        if self.keep_alive is not None:
            self.instance.keep_until = max(self.instance.keep_until, time.time() + self.keep_alive)
        return self.instance

    def release(self, finished: bool = True) -> None:
        """Give the slot back; `finished`: the request ended normally (else its slot may still be
        working for a moment: llama-server notices a closed connection only at its next check)."""
        if self.instance is not None:
            instance, self.instance = self.instance, None
            self._unpin(instance, finished)
            instance.failures = 0  # it was reached
            self.pool.release(instance, self.key_id)

    def failed(self) -> None:
        """The instance could not be reached: report it to its pool, give the slot back."""
        if self.instance is not None:
            instance, self.instance = self.instance, None
            self._unpin(instance, finished=False)
            self.failed_on = instance
            instance.failures += 1
            self.pool.report_failure(instance)
            self.pool.release(instance, self.key_id)

    def pin(self, start: int) -> tuple[int, bool, bool] | None:
        """Pin this request (its prompt's start hashed as `start`) to a slot of its instance: the slot,
        whether it may reuse the slot's cached prompt (only its own key's), and whether that is this
        conversation's; None for an instance other gateways also use."""
        instance = self.instance
        if instance is None or instance.shared:
            return None
        if self.slot is not None:
            instance.give_slot(self.slot, finished=False)
        self.slot, reuse, warm = instance.take_slot(self.key_id, start)
        return self.slot, reuse, warm

    def _unpin(self, instance: Instance, finished: bool) -> None:
        if self.slot is not None:
            instance.give_slot(self.slot, finished)
            self.slot = None


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
