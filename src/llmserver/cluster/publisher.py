"""A node's side of the registry: its instances published every second (cluster/records.py), its
claim on its node id, and the gateways' commands (`start`, `drain`) it runs — the node's end of the
command channel whose gateway end is cluster/commands.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmserver.cluster.records import (
    KEY,
    LEASE_MS,
    LOAD_KEY,
    NODE_KEY,
    PUBLISH_EVERY,
    PUBLISHED,
    READ_EVERY,
    STALL_KEY,
    STALL_NOTE_SECONDS,
    STOPPED_MS,
    record,
    scan_json,
)
from llmserver.errors import APIError, InvalidRequest
from llmserver.outage import Outage, redis_unreachable
from llmserver.pool.instance import Instance, Status
from llmserver.pool.supervisor import Supervisor

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("llmserver.pool.registry")  # its name before the move: log_levels name it


def _nothing_released(name: str, instance_id: str) -> None:
    """A node that runs its own [[models]]: an admin's drain there is no release for a scheduler."""


class NodeIdInUse(Exception):
    """Another live node publishes under this node id."""


class Publisher:
    """A node's side: its instances in the registry, every second."""

    def __init__(self, client: redis.asyncio.Redis, supervisor: Supervisor, node_id: str) -> None:
        self._redis = client
        self._supervisor = supervisor
        self.node_id = node_id
        self.incarnation = secrets.token_hex(8)  # a node that comes back is a new incarnation
        self._published: set[str] = set()
        self._outage = Outage(log)
        self.published_at = float("-inf")  # monotonic: the last publication Redis took
        # More of the node's record: a node that takes assignments adds its labels and model checks.
        self.extra: Callable[[], dict[str, Any]] = dict
        self.scheduled = False  # it runs the scheduler's assignments: no start by command
        self.on_release: Callable[[str, str], None] = _nothing_released  # an admin drained one of a model's
        self._in_flight: collections.Counter[str] = collections.Counter()  # per instance, every gateway's
        self.listener: str | None = None  # where gateways reach the node's listener (its saved prompts), if they can

    async def claim(self) -> None:
        """Take this node id in the registry, or raise NodeIdInUse when a live node holds it: its record
        is renewed every second, so it is still there a lease later (a node that just died lets go
        within a lease, and the claim then succeeds)."""
        record = json.dumps({"node": self.node_id, "incarnation": self.incarnation, "models": [], "instances": 0})
        deadline = time.monotonic() + (LEASE_MS + 500) / 1000
        while not await self._redis.set(NODE_KEY + self.node_id, record, nx=True, px=LEASE_MS):
            if time.monotonic() > deadline:
                held = await self._redis.get(NODE_KEY + self.node_id)
                other = json.loads(held).get("incarnation", "?") if held else "?"
                raise NodeIdInUse(
                    f"node id {self.node_id!r} is held by a live node (incarnation {other}): give this node "
                    "another node.id, or stop that one"
                )
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(PUBLISH_EVERY)

    async def stalled(self, instance: Instance, bound: float) -> None:
        """Before the watchdog restarts an instance that made no progress (the supervisor's `on_stall`):
        a note of its process and why, so that a gateway whose request that process drops fails it with
        the reason instead of sending it again to hang the restarted one (cluster/registry.py)."""
        note = {
            "pid": instance.pid, "failure": f"made no progress for {bound:.0f} s on node {self.node_id}",
            "blamed": sorted(instance.blamed),  # the keys whose grammar it was; none: every request it dropped
        }  # fmt: skip
        await self._redis.set(STALL_KEY + instance.id, json.dumps(note), ex=STALL_NOTE_SECONDS)

    async def publish(self) -> None:
        live = [i for i in self._supervisor.all_instances() if i.status in PUBLISHED and i.client is not None]
        in_flight: collections.Counter[str] = collections.Counter()
        active: dict[str, float] = {}
        kept: dict[str, float] = {}
        grammars: dict[str, set[str]] = collections.defaultdict(set)
        with contextlib.suppress(*redis_unreachable()):  # then publish() below logs the outage
            for load in await scan_json(self._redis, LOAD_KEY):
                in_flight.update(load["in_flight"])
                for instance_id, keys in load.get("grammars", {}).items():  # an older gateway sends none
                    grammars[instance_id].update(keys)
                for instance_id, when in load.get("active", {}).items():
                    active[instance_id] = max(active.get(instance_id, 0.0), float(when))
                for instance_id, until in load.get("kept", {}).items():  # an older gateway sends none
                    kept[instance_id] = max(kept.get(instance_id, 0.0), float(until))
        self._in_flight = in_flight
        for instance in self._supervisor.all_instances():  # whose requests on it carry a grammar, every gateway's
            carrying = grammars.get(instance.id, set())
            for ended in set(instance.grammars) - carrying:
                instance.last_grammar = (ended, time.monotonic())
            instance.grammars = dict.fromkeys(sorted(carrying), 1)
        for instance in live:  # the gateways' requests are its activity (idle_timeout counts from it)
            if active.get(instance.id, 0.0) > instance.last_activity:
                instance.last_activity = active[instance.id]
            # ... and their requests' keep_alive its keep_until (neither this node nor the scheduler
            # stops it for idleness before)
            instance.keep_until = max(instance.keep_until, kept.get(instance.id, 0.0))
            if in_flight[instance.id]:
                instance.last_activity = max(instance.last_activity, time.time())
        pools = self._supervisor.pools.items()
        pipe = self._redis.pipeline(transaction=False)
        node = {
            "node": self.node_id,
            "incarnation": self.incarnation,
            "models": sorted(self._supervisor.pools),
            "instances": len(live),
            "memory_used_mb": self._supervisor.memory_used_mb(),
            "memory_budget_mb": self._supervisor.memory_budget_mb,
            # Per model: its file downloading here, and the last instance that failed to start here.
            "fetching": {name: pool.fetching for name, pool in pools if pool.fetching},
            "failures": {name: pool.last_start_failure for name, pool in pools if pool.last_start_failure},
            "listener": self.listener,
            **self.extra(),
        }
        pipe.set(NODE_KEY + self.node_id, json.dumps(node), px=LEASE_MS)
        for instance in live:
            published = record(instance, self.node_id, self.incarnation, in_flight[instance.id])
            pipe.set(KEY + instance.id, json.dumps(published), px=LEASE_MS)
        gone = self._published - {i.id for i in live}
        for instance_id in gone:
            pipe.delete(KEY + instance_id)
        try:
            await pipe.execute()
        except redis_unreachable() as exc:
            self._outage.failed(
                "node %s cannot publish its instances (Redis: %s); retrying every second", self.node_id, exc
            )
            return
        self._outage.recovered("node %s publishes its instances again", self.node_id)
        self._published = {i.id for i in live}
        self.published_at = time.monotonic()

    async def settle(self, instance: Instance, timeout: float) -> None:
        """A draining instance's requests through every gateway finished (up to `timeout`): its draining
        state published at once, the gateways given two of their reads to stop routing to it, then
        their requests in flight on it waited for (the node sees none of them itself)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.publish()
                await asyncio.sleep(2 * READ_EVERY + 0.2)
                while True:
                    await self.publish()
                    if not self._in_flight[instance.id]:
                        return
                    await asyncio.sleep(0.2)

    async def withdraw(self) -> None:
        """At a clean stop: the node's instances leave the registry at once, marked stopped for a
        moment (the gateways then log a planned stop, not a lost node)."""
        with contextlib.suppress(Exception):
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(NODE_KEY + self.node_id)
            for instance in self._supervisor.all_instances():
                if instance.id in self._published:
                    stopped = {**record(instance, self.node_id, self.incarnation), "status": Status.STOPPED.value}
                    pipe.set(KEY + instance.id, json.dumps(stopped), px=STOPPED_MS)
            await pipe.execute()
        self._published = set()

    async def serve_commands(self) -> None:
        """Run the gateways' commands for this node, each in its own task (a start takes seconds)."""
        tasks: set[asyncio.Task[None]] = set()
        while True:
            try:
                popped = await self._redis.blpop([NODE_KEY + self.node_id + ":commands"], timeout=1)
            except redis_unreachable():
                await asyncio.sleep(1)  # publish() logs the outage
                continue
            if popped is None:
                continue
            task = asyncio.create_task(self._run_command(json.loads(popped[1])))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _released(self, instance: Instance) -> None:
        """An admin drains an instance of the scheduler's: released to it (cluster/assignments.py), published
        at once, and waited for until it has stopped — its replacement started first where its model needs
        it — or for `server.drain_timeout` (the gateway waits that long for the answer; it stops after)."""
        if instance.status in (Status.READY, Status.BUSY):
            self.on_release(instance.model.name, instance.id)
            await self.publish()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._supervisor.settings.server.drain_timeout):
                await instance.stopped.wait()

    async def _run_command(self, command: dict[str, Any]) -> None:
        try:
            if command["op"] == "start" and self.scheduled:
                raise InvalidRequest(
                    f"Node {self.node_id!r} runs what the scheduler assigns it: raise the model's min_instances "
                    f"in the catalog (PATCH /api/models/{command['model']}) instead.", param="node"
                )  # fmt: skip
            if command["op"] == "start":
                instance = await self._supervisor.start_instance(command["model"])
            elif command["op"] == "drain":
                instance = self._supervisor.find(command["instance_id"])
                if self.scheduled:  # the scheduler places its replacement (first, if the model needs it)
                    await self._released(instance)
                else:
                    await self._supervisor.drain(instance)
            else:
                raise InvalidRequest(f"unknown command {command['op']!r}")
            await self.publish()  # a started instance is routable at once
            reply: dict[str, Any] = {"ok": True, "record": record(instance, self.node_id, self.incarnation)}
        except APIError as exc:
            reply = {"ok": False, "status": exc.status, "type": exc.type, "message": exc.message}
        log.info("node %s: %s %s: %s", self.node_id, command["op"], command.get("model") or command.get("instance_id"),
                 "done" if reply["ok"] else reply["message"])  # fmt: skip
        reply_key = f"llmserver:reply:{command['id']}"
        with contextlib.suppress(Exception):
            await self._redis.rpush(reply_key, json.dumps(reply))
            await self._redis.expire(reply_key, 120)
