"""The instance registry in Redis: nodes publish their instances, gateways route to them.

A node (`llmserver node`) writes one key per instance every second, `llmserver:instance:ID` → the
instance's record as JSON (the seed's fields plus slots, in-flight, node and incarnation), expiring
after `LEASE_MS`: an instance whose node died or lost its link leaves the registry within 3 s. A
gateway of role `gateway` reads the registry every half second and keeps its pools in step: an
instance that appears joins its model's pool (a `RemoteInstance`, reached with `instance_api_key`),
one that vanishes or comes back under a new node incarnation leaves it. While Redis cannot be read,
a gateway keeps routing to the instances it knows (logged once); a node publishes again as soon as
Redis answers.

A gateway's side is here, in four parts: the registry read into its pools (this module, with its
circuit breakers), the records' keys (cluster/records.py), the load it shares with the other
gateways (cluster/sharing.py) and the commands it sends the nodes (cluster/commands.py); a node's
side is cluster/publisher.py, the instances it joins cluster/remote.py.

Each gateway keeps a circuit breaker per node instance: `CIRCUIT_FAILURES` requests in a row that
cannot reach it (a host killed, a link down between this gateway and that host while the node still
publishes) take it out of this gateway's routing, and pause the node's other instances too until one
of them answers (a dead host's instances all fail alike); a /health probe, after 1 s (0.5 s for the
node's others) and then doubling up to 8 s, puts each back. A failed request's retry goes to another
node's instance when there is one (pool.py).

"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmserver.cluster.commands import NodeCommands
from llmserver.cluster.records import KEY, LEASE_MS, LOAD_KEY, READ_EVERY, STALL_KEY, STATUS_KEY, scan_json
from llmserver.cluster.remote import RemoteInstance
from llmserver.cluster.sharing import LoadSharing
from llmserver.cluster.slots import SharedSlots
from llmserver.errors import InvalidRequest, NotFound
from llmserver.llama.client import LlamaServerClient
from llmserver.logs import background
from llmserver.outage import Outage, redis_unreachable
from llmserver.pool.instance import Instance, Status
from llmserver.pool.pool import ModelPool
from llmserver.pool.saved_prompts import SavedPrompts

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("llmserver.pool.registry")  # its name before the move: log_levels name it

CIRCUIT_FAILURES = 2  # requests in a row that cannot reach an instance open its circuit
PROBE_FIRST, PROBE_MAX = 1.0, 8.0  # seconds between probes of an open circuit, doubling
SUSPECT_FIRST = 0.5  # seconds before a suspected node's first probe (then doubling up to PROBE_MAX)


class Registry:
    """A gateway's side: its pools' remote instances, in step with the registry."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        pools: Mapping[str, ModelPool],
        api_key: str | None,
        gateway: str,
        tls: ssl.SSLContext | None = None,
        saved: SavedPrompts | None = None,
        min_tokens: int = 256,
    ) -> None:
        self._redis = client
        self._pools = pools
        self._api_key = api_key
        self._tls = tls  # verifies the certificates of instances published with https
        self._probes: set[asyncio.Task[None]] = set()
        self._suspected: set[str] = set()  # nodes not routed to until one of their instances answers
        self.load = LoadSharing(client, pools, gateway)
        # Whose prompt each slot holds, whose turn it is there, and the per-key tier under them (key isolation).
        self.slots = SharedSlots(client, gateway, saved=saved, min_tokens=min_tokens, api_key=api_key)
        self.commands = NodeCommands(client)
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
        self.load.adopt(pool)

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
            asyncio.create_task(self.load.write(), name="gateway-load-writer"),
            asyncio.create_task(self.load.listen(), name="gateway-load-listener"),
            asyncio.create_task(self.slots.renew(), name="slot-holds-renewal"),
        ]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._probes]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.load.withdraw()
        await self.slots.close()
        await self._redis.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(READ_EVERY)
            try:
                await self.sync()
            except Exception:
                log.exception("instance registry")

    async def read(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]] | None:
        """Every published record by instance id and the other gateways' loads, after writing this
        gateway's load; None when Redis cannot be read."""
        try:
            await self.load.keep()
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

    def unreachable(self, instance: RemoteInstance) -> None:
        """A request could not reach a node's instance (its retry goes to another node: pool.py). After
        `CIRCUIT_FAILURES` in a row its circuit opens (out of this gateway's routing until a probe
        reaches it), and no other instance of that node is routed to until one of them answers a probe
        either: a dead host's instances all fail alike. One failure alone may be a kept-alive connection
        the instance had just closed, which the retry's fresh connection gets past."""
        if instance.failures < CIRCUIT_FAILURES or instance.status in (Status.FAILED, Status.STOPPED):
            return
        self._suspect(instance)
        instance.status = Status.FAILED
        log.warning(
            "instance %s on node %s at %s could not be reached %d times in a row: not routed to until it answers",
            instance.id, instance.node, instance.base_url, instance.failures,
        )  # fmt: skip
        task = background(self._probe(instance), name=f"probe-{instance.id}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _node_instances(self, node: str) -> list[RemoteInstance]:
        return [
            i for pool in self._pools.values() for i in pool.instances
            if isinstance(i, RemoteInstance) and i.node == node
        ]  # fmt: skip

    def _suspect(self, instance: RemoteInstance) -> None:
        node = instance.node
        if node in self._suspected:
            return
        self._suspected.add(node)
        others = self._node_instances(node)
        for other in others:
            other.suspect = True
        log.warning(
            "instance %s on node %s could not be reached %d times in a row: the node's %d instances are not routed "
            "to until one answers",
            instance.id, node, instance.failures, len(others),
        )  # fmt: skip
        task = background(self._confirm(node), name=f"confirm-{node}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _confirm(self, node: str) -> None:
        """Probe a suspected node's instances until one answers (its instances routed to again), or the
        registry no longer lists any (a dead node's records lapse within LEASE_MS)."""
        delay, opened = SUSPECT_FIRST, time.monotonic()
        try:
            while True:
                await asyncio.sleep(delay)
                candidates = [i for i in self._node_instances(node) if i.client is not None
                              and i.status not in (Status.FAILED, Status.STOPPED)]  # fmt: skip
                if not candidates:
                    return
                if any(await asyncio.gather(*(i.client.healthy() for i in candidates[:2] if i.client is not None))):
                    log.info("node %s answers again after %.1f s: routed to again", node, time.monotonic() - opened)
                    return
                delay = min(PROBE_MAX, delay * 2)
        finally:
            self._suspected.discard(node)
            for instance in self._node_instances(node):
                instance.suspect = False
            for pool in self._pools.values():
                pool.dispatch()

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
            cold = not pool.ready and pool.queue_depth > 0
            pool.instances.append(instance)
            log.info(
                "instance %s (%s) on node %s at %s joined",
                instance.id, pool.name, instance.node, instance.base_url,
            )  # fmt: skip
            if cold and instance.accepting:  # requests here waited for it: a cold start, as this gateway saw it
                waited = pool.longest_wait()
                pool.cold_starts += 1
                pool.cold_start_seconds += waited
                log.info("cold start of %s on node %s: ready after %.1f s for %d waiting requests",
                         pool.name, instance.node, waited, pool.queue_depth)  # fmt: skip
        self.load.heard(others, complete=True)  # and slots to waiters: on instances that joined too

    @staticmethod
    def _update(instance: RemoteInstance, published: dict[str, Any]) -> None:
        instance.remote = published
        if published["status"] == Status.DRAINING.value:
            instance.status = Status.DRAINING
        elif instance.status == Status.DRAINING:
            instance.status = Status.READY

    async def start_instance(self, model: str, node: str | None, timeout: float) -> Instance:
        """One more instance of `model` on `node`, or on the node with the fewest instances that serves it."""
        nodes = [n for n in await self.commands.nodes() if model in n["models"] and (node is None or n["node"] == node)]
        if not nodes:
            where = f"node {node!r}" if node else "no node"
            raise InvalidRequest(f"{where.capitalize()} runs the model {model!r}.", param="node" if node else "model")
        chosen = min(nodes, key=lambda n: (n["instances"], n["node"]))["node"]
        reply = await self.commands.command(chosen, "start", timeout, model=model)
        await self.sync()
        pool = self._pools[model]
        joined = next((i for i in pool.instances if i.id == reply["record"]["instance_id"]), None)
        if joined is None:
            raise NotFound("The node started the instance but it is not in the registry yet; list instances again.")
        return joined

    async def stall_reason(self, instance: RemoteInstance, pid: int | None, key_id: str | None = None) -> str | None:
        """Why its node's watchdog restarted the process `pid` of the instance, if it did (its note) and held
        it against the request of `key_id` (the keys whose requests carried a grammar; none noted: all)."""
        try:
            note = await self._redis.get(STALL_KEY + instance.id)
        except Exception:  # Redis unreachable: a dropped connection, as far as this gateway knows
            return None
        if not note or pid is None:
            return None
        stalled = json.loads(note)
        blamed = stalled.get("blamed") or []
        if stalled.get("pid") != pid or (key_id is not None and blamed and key_id not in blamed):
            return None
        return str(stalled["failure"])

    async def drain(self, instance: RemoteInstance, timeout: float) -> None:
        """Drain an instance on its node; it leaves this gateway's pool at once."""
        instance.status = Status.DRAINING
        await self.commands.command(instance.node, "drain", timeout, instance_id=instance.id)
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
