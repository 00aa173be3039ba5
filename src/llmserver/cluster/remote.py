"""An instance a node runs on another host, as a gateway sees it: reached over HTTP(S) with the
instance key, its state the node's published record, its circuit breaker and drains the gateway's
registry's (cluster/registry.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from llmserver.cluster.slots import SharedSlots
from llmserver.pool.instance import Instance, Status


class Home(Protocol):
    """The registry that joined a remote instance."""

    slots: SharedSlots

    def unreachable(self, instance: RemoteInstance) -> None: ...
    async def drain(self, instance: RemoteInstance, timeout: float) -> None: ...
    async def stall_reason(
        self, instance: RemoteInstance, pid: int | None, key_id: str | None = None
    ) -> str | None: ...


@dataclass(eq=False)
class RemoteInstance(Instance):
    """An instance a node runs on another host, as a gateway sees it."""

    shared: ClassVar[bool] = True
    log_here: ClassVar[bool] = False
    last_activity: float = 0.0  # this gateway's last use (the node publishes every gateway's)
    node: str = ""
    incarnation: str = ""
    remote: dict[str, Any] = field(default_factory=dict)
    registry: Home | None = None  # the gateway's registry that joined it: its circuit breaker and commands
    # Another instance of its node just dropped a connection: not routed to until the node answers.
    suspect: bool = False

    @property
    def accepting(self) -> bool:
        return super().accepting and not self.suspect

    @property
    def placed_on(self) -> str:
        return self.node

    @property
    def pid(self) -> int | None:
        return int(self.remote.get("pid") or 0) or None

    @property
    def exited(self) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        described = {key: self.remote[key] for key in super().describe() if key in self.remote}
        return {**described, "status": self.status.value, "active_users": len(self.users), "node": self.node}

    async def start(self, binary: Path, model_file: Path, timeout: float, mmproj: Path | None = None) -> None:
        raise RuntimeError("a remote instance is started by its node")

    def unreachable(self) -> str | None:
        if self.registry is not None:
            self.registry.unreachable(self)
        return None  # out of this gateway's routing only once its circuit opens

    async def drained_elsewhere(self, timeout: float) -> bool:
        if self.registry is None:
            return False
        await self.registry.drain(self, timeout + 10)
        return True

    @property
    def slot_count(self) -> int:
        return int(self.remote.get("slots") or self.model.parallel)  # as its node runs it

    async def claim_slot(self, key_id: str, start: int, size: int) -> tuple[int, bool, str] | None:
        if self.registry is None:
            return None
        prompts = self.remote.get("prompts")  # the node saves its slots' caches: the tier runs here too
        folder = f"{self.node}:{prompts}" if prompts else None
        return await self.registry.slots.pin(self.id, self.slot_count, key_id, start, size, self.client, folder)

    def free_slot(
        self, slot: int, hold: str, finished: bool, conversation: tuple[str, int, int]
    ) -> asyncio.Task[None] | None:
        if self.registry is None:
            return None
        return self.registry.slots.give(self.id, self.slot_count, slot, hold, finished, conversation)

    async def answers_slots(self, timeout: float) -> bool:
        return True  # its node's watchdog probes it (the node sees no requests: it probes them all)

    async def stall_reason(self, pid: int | None, key_id: str | None = None) -> str | None:
        return None if self.registry is None else await self.registry.stall_reason(self, pid, key_id)

    async def stop(self, grace: float = 10.0) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        self.status = Status.STOPPED
