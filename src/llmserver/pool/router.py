"""Admission and routing: the per-key concurrency limit, then a slot from the model's pool.

Both checks run before anything is sent to an instance, so before any prompt is templated or
tokenized. The lease holds the slot (and the key's count) until the request is over.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from llmserver.auth.keys import Principal
from llmserver.errors import RateLimited
from llmserver.pool.instance import Instance
from llmserver.pool.pool import ModelPool
from llmserver.pool.supervisor import Supervisor


class Router:
    def __init__(self, supervisor: Supervisor, max_concurrency_per_key: int) -> None:
        self._supervisor = supervisor
        self._max_per_key = max_concurrency_per_key
        self._per_key: collections.Counter[str] = collections.Counter()

    def check_model(self, name: str) -> ModelPool:
        return self._supervisor.pool(name)

    @asynccontextmanager
    async def lease(self, model: str, principal: Principal) -> AsyncIterator[Instance]:
        pool = self._supervisor.pool(model)
        key = principal.key_id
        limit = principal.limits.max_concurrency or self._max_per_key
        if self._per_key[key] >= limit:
            raise RateLimited(
                f"This API key already has {self._per_key[key]} requests in flight, its limit. "
                "Retry when one has finished.",
                retry_after=1,
            )
        self._per_key[key] += 1
        try:
            instance = await pool.acquire(key)
            try:
                yield instance
            finally:
                pool.release(instance, key)
        finally:
            self._per_key[key] -= 1
            if self._per_key[key] <= 0:
                del self._per_key[key]

    def instance_failed(self, instance: Instance) -> None:
        """A request could not reach its instance: if the process is gone, take it out of service now."""
        if instance.exited and instance.process is not None:
            self._supervisor.crashed(instance, f"pid {instance.pid} died with code {instance.process.returncode}")
