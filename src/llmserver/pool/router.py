"""Routing: each request goes to the accepting instance of its model with the fewest in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from llmserver.engine.client import LlamaServerClient
from llmserver.errors import ModelNotFound, Overloaded
from llmserver.pool.instance import Instance
from llmserver.pool.supervisor import Supervisor


class Router:
    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def check_model(self, name: str) -> None:
        if name not in self._supervisor.instances:
            raise ModelNotFound(f"The model {name!r} does not exist.", param="model")

    def pick(self, name: str) -> Instance:
        self.check_model(name)
        candidates = [i for i in self._supervisor.instances[name] if i.accepting]
        if not candidates:
            raise Overloaded(f"No instance of {name!r} is ready; try again shortly.", retry_after=2)
        return min(candidates, key=lambda i: i.in_flight)

    @contextmanager
    def lease(self, instance: Instance) -> Iterator[LlamaServerClient]:
        """Count a request in flight on the instance for as long as the block runs."""
        client = instance.client
        if client is None:
            raise Overloaded(f"The instance {instance.id} is no longer available.", retry_after=1)
        instance.in_flight += 1
        instance.refresh_status()
        try:
            yield client
        finally:
            instance.in_flight -= 1
            instance.last_activity = time.time()
            instance.refresh_status()
