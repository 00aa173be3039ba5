"""The instance registry in Redis: nodes publish their instances, gateways route to them.

A node (`llmserver node`) writes one key per instance every second, `llmserver:instance:ID` → the
instance's record as JSON (the seed's fields plus slots, in-flight, node and incarnation), expiring
after `LEASE_MS`: an instance whose node died or lost its link leaves the registry within 3 s. A
gateway of role `gateway` reads the registry every half second and keeps its pools in step: an
instance that appears joins its model's pool (a `RemoteInstance`, reached with `instance_api_key`),
one that vanishes or comes back under a new node incarnation leaves it. While Redis cannot be read,
a gateway keeps routing to the instances it knows (logged once); a node publishes again as soon as
Redis answers.

The admin API reaches nodes through a command channel: a gateway pushes `start` or `drain` onto
the node's list (`llmserver:node:ID:commands`), the node runs it and pushes the outcome onto a reply
list the gateway waits on. Each node also publishes its own record (`llmserver:node:ID`: models,
instances), so that a gateway can pick the node with the fewest instances of the model.

Gateways share their load: each publishes its requests in flight per instance and waiting per model
on the channel `llmserver:load` as soon as they change (coalesced) and keeps them in
`llmserver:load:GATEWAY` (expiring after a lease, read with the registry: a gateway that stopped
drops out), so that routing counts every gateway's requests on an instance, the queue's `max_queue`
bounds every gateway's waiters together, and a gateway holding more than its share of a model's
slots while others' requests wait lets them have the next ones (pool/pool.py). The counts are a
Redis round trip old; llama-server queues a request that lands on a slot taken meanwhile. A
request's end is the exception: its answer waits until the freed slot has been published
(`shared`), so that the client's next request, to whichever gateway, finds the slot free.

Each gateway keeps a circuit breaker per node instance: `CIRCUIT_FAILURES` requests in a row that
cannot reach it (a link down between this gateway and that host while the node still publishes)
take it out of this gateway's routing; a /health probe, after 1 s and then doubling up to 8 s,
puts it back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from llmserver.errors import APIError, GatewayTimeout, InvalidRequest, NotFound
from llmserver.llama.client import LlamaServerClient
from llmserver.logs import background
from llmserver.outage import Outage, redis_unreachable
from llmserver.pool.instance import Instance, Status
from llmserver.pool.pool import ModelPool

if TYPE_CHECKING:
    import redis.asyncio

    from llmserver.pool.supervisor import Supervisor

log = logging.getLogger("llmserver.pool.registry")  # its name before the move: log_levels name it

KEY = "llmserver:instance:"
NODE_KEY = "llmserver:node:"
LOAD_KEY = "llmserver:load:"
LOAD_CHANNEL = "llmserver:load"
ASSIGN_KEY = "llmserver:assign:"  # + node id: what the scheduler (cluster/scheduler.py) has it run
STATUS_KEY = "llmserver:schedule"  # the scheduler's last round: the catalog, and what it could not place
LEASE_MS = 3000
STOPPED_MS = 5000  # how long a cleanly stopped node's instances stay in the registry, marked stopped
ACTIVE_WINDOW = 10.0  # seconds: a gateway's load names the instances it used this recently
PUBLISH_EVERY = 1.0
READ_EVERY = 0.5
# The longest a request's end waits for its freed slot to reach the other gateways (`shared`).
SHARE_WAIT = 0.1
PUBLISHED = (Status.READY, Status.BUSY, Status.DRAINING)
CIRCUIT_FAILURES = 2  # requests in a row that cannot reach an instance open its circuit
PROBE_FIRST, PROBE_MAX = 1.0, 8.0  # seconds between probes of an open circuit, doubling


async def scan_json(client: redis.asyncio.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every JSON value stored under keys starting with `prefix` (keys of other types, such as a
    node's command list, read as nothing)."""
    keys = [key async for key in client.scan_iter(match=prefix + "*", count=500)]
    return [json.loads(value) for value in await client.mget(keys) if value] if keys else []


def record(instance: Instance, node_id: str, incarnation: str, in_flight: int = 0) -> dict[str, Any]:
    return {
        **instance.describe(),
        "slots": instance.model.parallel,
        "in_flight": in_flight,  # through every gateway, from their loads
        "node": node_id,
        "incarnation": incarnation,
        "scheme": "http" if instance.tls is None else "https",
        "idle_seconds": 0.0 if in_flight else round(max(0.0, time.time() - instance.last_activity), 1),
    }


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
        self._in_flight: collections.Counter[str] = collections.Counter()  # per instance, every gateway's

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
                    "another node_id, or stop that one"
                )
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(PUBLISH_EVERY)

    async def publish(self) -> None:
        live = [i for i in self._supervisor.all_instances() if i.status in PUBLISHED and i.client is not None]
        in_flight: collections.Counter[str] = collections.Counter()
        active: dict[str, float] = {}
        with contextlib.suppress(*redis_unreachable()):  # then publish() below logs the outage
            for load in await scan_json(self._redis, LOAD_KEY):
                in_flight.update(load["in_flight"])
                for instance_id, when in load.get("active", {}).items():
                    active[instance_id] = max(active.get(instance_id, 0.0), float(when))
        self._in_flight = in_flight
        for instance in live:  # the gateways' requests are its activity (idle_timeout counts from it)
            if active.get(instance.id, 0.0) > instance.last_activity:
                instance.last_activity = active[instance.id]
            if in_flight[instance.id]:
                instance.last_activity = max(instance.last_activity, time.time())
        pipe = self._redis.pipeline(transaction=False)
        node = {
            "node": self.node_id,
            "incarnation": self.incarnation,
            "models": sorted(self._supervisor.pools),
            "instances": len(live),
            "memory_used_mb": self._supervisor.memory_used_mb(),
            "memory_budget_mb": self._supervisor.memory_budget_mb,
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


@dataclass(eq=False)
class RemoteInstance(Instance):
    """An instance a node runs on another host, as a gateway sees it."""

    shared: ClassVar[bool] = True
    last_activity: float = 0.0  # this gateway's last use (the node publishes every gateway's)
    node: str = ""
    incarnation: str = ""
    remote: dict[str, Any] = field(default_factory=dict)
    registry: Registry | None = None  # the gateway's registry that joined it: its circuit breaker and commands

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

    async def answers_slots(self, timeout: float) -> bool:
        return True  # a node's: its gateways' request_timeout applies (the node sees no requests)

    async def stop(self, grace: float = 10.0) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        self.status = Status.STOPPED


class Registry:
    """A gateway's side: its pools' remote instances, in step with the registry."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        pools: Mapping[str, ModelPool],
        api_key: str | None,
        gateway: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._redis = client
        self._pools = pools
        self._api_key = api_key
        self._tls = tls  # verifies the certificates of instances published with https
        self._load_key = LOAD_KEY + gateway
        self._probes: set[asyncio.Task[None]] = set()
        self._gateway = gateway
        self._load_changed = asyncio.Event()
        self._changes = 0  # load changes made, counted
        self._shared = 0  # how many of them the last load written to Redis showed
        self._unshared = False  # the last write failed: nobody waits for the next
        self._sharing: list[tuple[int, asyncio.Future[None]]] = []  # (changes, woken once shared)
        # Orders this gateway's load messages, across its restarts too (nanoseconds, strictly
        # increasing): a read that crossed a newer message never overwrites it.
        self._sequence = 0
        self._loads: dict[str, dict[str, Any]] = {}  # the other gateways' latest, by gateway id
        self._tasks: list[asyncio.Task[None]] = []
        for pool in pools.values():
            self.adopt(pool)
        self._outage = Outage(log)
        self._unknown: set[str] = set()
        self._recovered_at = 0.0
        self.read_at = float("-inf")  # monotonic: the last read of the registry that succeeded
        self.published: dict[str, int] = {}  # instances published per node, at the last read

    @property
    def client(self) -> redis.asyncio.Redis:
        """Its Redis connection (the scheduler shares it)."""
        return self._redis

    def adopt(self, pool: ModelPool) -> None:
        """A pool whose load this gateway shares (each one at start, and each the catalog adds)."""
        pool.on_load = self._changed
        pool.load_shared = self.shared

    async def start(self, first_read: float = 5.0) -> None:
        """Read the registry once before the gateway takes requests (within `first_read` seconds:
        a gateway that knew only the first instance to answer would send it every request and
        scatter conversations away from their homes), then keep reading."""
        try:
            async with asyncio.timeout(first_read):
                await self.sync()
        except Exception as exc:  # an outage is logged by read(); serving starts without instances
            if not isinstance(exc, TimeoutError):
                log.exception("instance registry")
        self._tasks = [
            asyncio.create_task(self._run(), name="instance-registry"),
            asyncio.create_task(self._write_load(), name="gateway-load-writer"),
            asyncio.create_task(self._listen_load(), name="gateway-load-listener"),
        ]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._probes]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await self._redis.delete(self._load_key)
        await self._redis.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(READ_EVERY)
            try:
                await self.sync()
            except Exception:
                log.exception("instance registry")

    def _changed(self) -> None:
        self._changes += 1
        self._load_changed.set()

    async def shared(self) -> None:
        """Wait until the load changes made so far have been written to Redis, and so sent to the
        other gateways (at most `SHARE_WAIT`; not at all while Redis cannot be written). A gateway
        hears another's message a few ms after it is sent, 9 ms measured on a busy 2-core machine,
        while a client that gets its answer can send its next turn to another gateway sooner: that
        gateway then counted the slot as still taken and sent the turn away from its prompt cache."""
        wanted = self._changes
        if self._shared >= wanted or self._unshared:
            return
        future = asyncio.get_running_loop().create_future()
        self._sharing.append((wanted, future))
        try:
            async with asyncio.timeout(SHARE_WAIT):
                await future
        except TimeoutError:
            with contextlib.suppress(ValueError):  # unless a write just dropped it
                self._sharing.remove((wanted, future))

    async def _write_load(self) -> None:
        """This gateway's load, in its key and to the other gateways, as soon as it changes
        (coalesced: the changes made while one message is sent go in the next)."""
        while True:
            await self._load_changed.wait()
            self._load_changed.clear()
            changes = self._changes
            load = json.dumps(self._own_load())
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._load_key, load, px=LEASE_MS)
            pipe.publish(LOAD_CHANNEL, load)
            try:
                await pipe.execute()
            except redis_unreachable():
                self._unshared = True
                self._wake_sharing(everyone=True)
                await asyncio.sleep(READ_EVERY)  # sync() logs the outage
                self._load_changed.set()
                continue
            self._shared, self._unshared = changes, False
            self._wake_sharing()

    def _wake_sharing(self, everyone: bool = False) -> None:
        waiting = []
        for wanted, future in self._sharing:
            if everyone or wanted <= self._shared:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((wanted, future))
        self._sharing = waiting

    async def _listen_load(self) -> None:
        """The other gateways' load as they publish it (the registry's reads fill gaps and expire
        the gateways that stopped)."""
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(LOAD_CHANNEL)
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            self._heard([json.loads(message["data"])])
            except redis_unreachable():
                await asyncio.sleep(1)  # sync() logs the outage

    def _heard(self, loads: list[dict[str, Any]], complete: bool = False) -> None:
        """Other gateways' loads into the pools; `complete`: every live gateway's (a read)."""
        latest = {} if complete else dict(self._loads)
        for load in loads:
            gateway = load["gateway"]
            if gateway == self._gateway:
                continue
            known = self._loads.get(gateway)
            latest[gateway] = known if known and known["sequence"] > load["sequence"] else load
        self._loads = latest
        self._share_load(list(latest.values()))
        for pool in self._pools.values():
            pool.dispatch()  # slots other gateways freed

    async def read(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]] | None:
        """Every published record by instance id and the other gateways' loads, after writing this
        gateway's load; None when Redis cannot be read."""
        try:
            await self._redis.set(self._load_key, json.dumps(self._own_load()), px=LEASE_MS)
            records = await scan_json(self._redis, KEY)
            loads = await scan_json(self._redis, LOAD_KEY)
            schedule = await self._redis.get(STATUS_KEY)
        except redis_unreachable() as exc:
            self._outage.failed("the instance registry cannot be read (Redis: %s): routing to the instances known", exc)
            return None
        if self._outage.recovered("the instance registry can be read again"):
            self._recovered_at = time.monotonic()
        self.read_at = time.monotonic()
        # What the scheduler could not place, and why: the reason a request for it waits in vain.
        blocked = json.loads(schedule).get("blocked", {}) if schedule else {}
        for name, pool in self._pools.items():
            pool.blocked = blocked.get(name)
        return {r["instance_id"]: r for r in records}, loads

    def _own_load(self) -> dict[str, Any]:
        self._sequence = max(self._sequence + 1, time.time_ns())
        recent = time.time() - ACTIVE_WINDOW
        return {
            "gateway": self._gateway,
            "sequence": self._sequence,
            "in_flight": {i.id: i.in_flight for p in self._pools.values() for i in p.instances if i.in_flight},
            # When this gateway last used each instance: the node's idle_timeout and last_activity count from it.
            "active": {
                i.id: round(i.last_activity, 3)
                for p in self._pools.values()
                for i in p.instances
                if i.last_activity > recent
            },
            "queued": {name: pool.queue_depth for name, pool in self._pools.items() if pool.queue_depth},
        }

    def _share_load(self, others: list[dict[str, Any]]) -> None:
        """The other gateways' requests, in flight per instance and waiting per model, into the pools."""
        for name, pool in self._pools.items():
            waiting = [o for o in others if o["queued"].get(name)]
            pool.queued_elsewhere = sum(o["queued"][name] for o in waiting)
            ids = {i.id for i in pool.instances}
            for instance in pool.instances:
                instance.elsewhere = sum(o["in_flight"].get(instance.id, 0) for o in others)
                instance.refresh_status()
            busy = [o for o in others if o["queued"].get(name) or ids & o["in_flight"].keys()]
            places = sum(i.model.most_in_flight for i in pool.instances if i.accepting)
            pool.share = max(1, -(-places // (1 + len(busy)))) if waiting else None

    def unreachable(self, instance: RemoteInstance) -> None:
        """A request could not reach a node's instance: after `CIRCUIT_FAILURES` in a row, stop
        routing to it until a probe reaches it again."""
        if instance.failures < CIRCUIT_FAILURES or instance.status in (Status.FAILED, Status.STOPPED):
            return
        instance.status = Status.FAILED
        log.warning(
            "instance %s on node %s at %s could not be reached %d times in a row: not routed to until it answers",
            instance.id, instance.node, instance.base_url, instance.failures,
        )  # fmt: skip
        task = background(self._probe(instance), name=f"probe-{instance.id}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, instance: RemoteInstance) -> None:
        delay = PROBE_FIRST
        opened = time.monotonic()
        while instance.status == Status.FAILED and instance.client is not None:
            await asyncio.sleep(delay)
            if instance.client is not None and await instance.client.healthy():
                instance.failures = 0
                instance.status = Status.READY
                instance.refresh_status()
                log.info(
                    "instance %s on node %s answers again after %.1f s: routed to again",
                    instance.id, instance.node, time.monotonic() - opened,
                )  # fmt: skip
                if (pool := self._pools.get(instance.model.name)) is not None:
                    pool.dispatch()
                return
            delay = min(PROBE_MAX, delay * 2)

    async def sync(self) -> None:
        read = await self.read()
        if read is None:
            return
        records, others = read
        self.published = dict(
            collections.Counter(str(r["node"]) for r in records.values() if r["status"] != Status.STOPPED.value)
        )
        # A Redis that restarted empty knows no instance until the nodes publish again (within a
        # second): removals wait one lease after an outage, so that the pools are not emptied.
        settled = time.monotonic() - self._recovered_at >= LEASE_MS / 1000
        for pool in self._pools.values() if settled else ():
            for instance in list(pool.instances):
                if not isinstance(instance, RemoteInstance):
                    continue
                current = records.get(instance.id)
                stopped = current is not None and current["status"] == Status.STOPPED.value
                if current is None or stopped or current["incarnation"] != instance.incarnation:
                    pool.instances.remove(instance)
                    # A drain or a node's clean stop was planned; an instance that vanished was not.
                    planned = stopped or instance.status == Status.DRAINING
                    log.log(
                        logging.INFO if planned else logging.WARNING,
                        "instance %s (%s) on node %s %s: no longer routed to",
                        instance.id, pool.name, instance.node,
                        "was stopped by its node" if planned else "left the registry (its node stopped publishing it)",
                    )  # fmt: skip
                    await instance.stop()
        joining: list[tuple[ModelPool, dict[str, Any]]] = []
        for instance_id, published in records.items():
            if published["status"] == Status.STOPPED.value:
                continue
            serving = self._pools.get(published["model"])
            if serving is None:
                if published["model"] not in self._unknown:
                    self._unknown.add(published["model"])
                    log.warning(
                        "node %s publishes model %r, which this gateway does not serve",
                        published["node"],
                        published["model"],
                    )
                continue
            known = next((i for i in serving.instances if i.id == instance_id), None)
            if known is None:
                joining.append((serving, published))
                continue
            assert isinstance(known, RemoteInstance)
            self._update(known, published)
        # Instances that appeared together join together: a request routed between two joins
        # would see only the first.
        joined = await asyncio.gather(*(self._join(pool, published) for pool, published in joining))
        for (pool, published), instance in zip(joining, joined, strict=True):
            self._update(instance, published)
            pool.instances.append(instance)
            log.info(
                "instance %s (%s) on node %s at %s joined",
                instance.id, pool.name, instance.node, instance.base_url,
            )  # fmt: skip
        self._heard(others, complete=True)  # and slots to waiters: on instances that joined too

    @staticmethod
    def _update(instance: RemoteInstance, published: dict[str, Any]) -> None:
        instance.remote = published
        if published["status"] == Status.DRAINING.value:
            instance.status = Status.DRAINING
        elif instance.status == Status.DRAINING:
            instance.status = Status.READY

    async def command(self, node: str, op: str, timeout: float, **args: str) -> dict[str, Any]:
        """Send a node a command and wait for its outcome (504 when it does not answer in time)."""
        command_id = secrets.token_hex(8)
        await self._redis.rpush(NODE_KEY + node + ":commands", json.dumps({"id": command_id, "op": op, **args}))
        popped = await self._redis.blpop([f"llmserver:reply:{command_id}"], timeout=max(1, int(timeout)))
        if popped is None:
            raise GatewayTimeout(f"Node {node!r} did not answer the {op} command within {timeout:.0f} s.")
        reply: dict[str, Any] = json.loads(popped[1])
        if not reply["ok"]:
            error = type("NodeError", (APIError,), {"status": reply["status"], "type": reply["type"]})
            raise error(f"Node {node!r}: {reply['message']}")
        return reply

    async def nodes(self) -> list[dict[str, Any]]:
        return await scan_json(self._redis, NODE_KEY)

    async def start_instance(self, model: str, node: str | None, timeout: float) -> Instance:
        """One more instance of `model` on `node`, or on the node with the fewest instances that serves it."""
        nodes = [n for n in await self.nodes() if model in n["models"] and (node is None or n["node"] == node)]
        if not nodes:
            where = f"node {node!r}" if node else "no node"
            raise InvalidRequest(f"{where.capitalize()} runs the model {model!r}.", param="node" if node else "model")
        chosen = min(nodes, key=lambda n: (n["instances"], n["node"]))["node"]
        reply = await self.command(chosen, "start", timeout, model=model)
        await self.sync()
        pool = self._pools[model]
        joined = next((i for i in pool.instances if i.id == reply["record"]["instance_id"]), None)
        if joined is None:
            raise NotFound("The node started the instance but it is not in the registry yet; list instances again.")
        return joined

    async def drain(self, instance: RemoteInstance, timeout: float) -> None:
        """Drain an instance on its node; it leaves this gateway's pool at once."""
        instance.status = Status.DRAINING
        await self.command(instance.node, "drain", timeout, instance_id=instance.id)
        pool = self._pools.get(instance.model.name)
        if pool is not None and instance in pool.instances:
            pool.instances.remove(instance)
        await instance.stop()

    async def _join(self, pool: ModelPool, published: dict[str, Any]) -> RemoteInstance:
        """A published instance, ready to join `pool` (the caller adds it)."""
        instance = RemoteInstance(
            model=pool.config,
            host=published["host"],
            port=int(published["port"]),
            log_path=Path(os.devnull),
            id=published["instance_id"],
            status=Status.READY,
            started_at=time.time() - float(published.get("uptime_seconds") or 0),
            node=published["node"],
            incarnation=published["incarnation"],
            remote=published,
            registry=self,
            tls=(self._tls or ssl.create_default_context()) if published.get("scheme") == "https" else None,
        )
        instance.client = LlamaServerClient(
            instance.base_url, connections=pool.config.most_in_flight + 2, api_key=self._api_key, tls=instance.tls
        )
        instance.template = await instance.learn_template()
        return instance
