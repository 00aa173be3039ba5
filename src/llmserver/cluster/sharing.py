"""Gateways share their load: each publishes its requests in flight per instance and waiting per model
on the channel `llmserver:load` as soon as they change (coalesced) and keeps them in
`llmserver:load:GATEWAY` (expiring after a lease, read with the registry: a gateway that stopped
drops out), so that routing counts every gateway's requests on an instance, the queue's `max_queue`
bounds every gateway's waiters together, and a gateway holding more than its share of a model's
slots while others' requests wait lets them have the next ones, and gives its streams' slots back after
`limits.fair_slice` while others below their share of the slots wait (pool/pool.py). It also says when it
last used each instance and until when a request's `keep_alive` keeps one (`kept`): the node that runs
the instance counts its idleness from those (cluster/publisher.py). The counts are a
Redis round trip old; llama-server queues a request that lands on a slot taken meanwhile. A
request's end is the exception: its answer waits until the freed slot has been published
(`shared`), so that the client's next request, to whichever gateway, finds the slot free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmserver.cluster.records import ACTIVE_WINDOW, LEASE_MS, LOAD_CHANNEL, LOAD_KEY, READ_EVERY
from llmserver.outage import redis_unreachable
from llmserver.pool.pool import ModelPool

if TYPE_CHECKING:
    import redis.asyncio

# The longest a request's end waits for its freed slot to reach the other gateways (`shared`).
SHARE_WAIT = 0.1


class LoadSharing:
    """This gateway's load out to the others, theirs into its pools."""

    def __init__(self, client: redis.asyncio.Redis, pools: Mapping[str, ModelPool], gateway: str) -> None:
        self._redis = client
        self._pools = pools
        self._gateway = gateway
        self._load_key = LOAD_KEY + gateway
        self._load_changed = asyncio.Event()
        self._changes = 0  # load changes made, counted
        self._shared = 0  # how many of them the last load written to Redis showed
        self._unshared = False  # the last write failed: nobody waits for the next
        self._sharing: list[tuple[int, asyncio.Future[None]]] = []  # (changes, woken once shared)
        # Orders this gateway's load messages, across its restarts too (nanoseconds, strictly
        # increasing): a read that crossed a newer message never overwrites it.
        self._sequence = 0
        self._loads: dict[str, dict[str, Any]] = {}  # the other gateways' latest, by gateway id

    def adopt(self, pool: ModelPool) -> None:
        """A pool whose load this gateway shares (each one at start, and each the catalog adds)."""
        pool.on_load = self.changed
        pool.load_shared = self.shared

    async def keep(self) -> None:
        """This gateway's load in its key (renewed with each read of the registry)."""
        await self._redis.set(self._load_key, json.dumps(self.own()), px=LEASE_MS)

    async def withdraw(self) -> None:
        with contextlib.suppress(Exception):
            await self._redis.delete(self._load_key)

    def changed(self) -> None:
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

    async def write(self) -> None:
        """This gateway's load, in its key and to the other gateways, as soon as it changes
        (coalesced: the changes made while one message is sent go in the next)."""
        while True:
            await self._load_changed.wait()
            self._load_changed.clear()
            changes = self._changes
            load = json.dumps(self.own())
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._load_key, load, px=LEASE_MS)
            pipe.publish(LOAD_CHANNEL, load)
            try:
                await pipe.execute()
            except redis_unreachable():
                self._unshared = True
                self._wake_sharing(everyone=True)
                await asyncio.sleep(READ_EVERY)  # the registry's read logs the outage
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

    async def listen(self) -> None:
        """The other gateways' load as they publish it (the registry's reads fill gaps and expire
        the gateways that stopped)."""
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(LOAD_CHANNEL)
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            self.heard([json.loads(message["data"])])
            except redis_unreachable():
                await asyncio.sleep(1)  # the registry's read logs the outage

    def heard(self, loads: list[dict[str, Any]], complete: bool = False) -> None:
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
            pool.rebalance()  # ... or that they wait for: fair shares between gateways in time

    def own(self) -> dict[str, Any]:
        self._sequence = max(self._sequence + 1, time.time_ns())
        now = time.time()
        recent = now - ACTIVE_WINDOW
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
            # Until when a request's keep_alive keeps each instance from idling out (the node stops none before).
            "kept": {
                i.id: round(i.keep_until, 3) for p in self._pools.values() for i in p.instances if i.keep_until > now
            },
            "queued": {name: pool.queue_depth for name, pool in self._pools.items() if pool.queue_depth},
            # The keys whose requests on each instance carry a grammar: the node's watchdog holds a stall against
            # them (pool/supervisor.py), and this gateway sends the other keys' requests again.
            "grammars": {i.id: sorted(i.grammars) for p in self._pools.values() for i in p.instances if i.grammars},
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
            pool.gateways_elsewhere = [
                (sum(o["in_flight"].get(i, 0) for i in ids), int(o["queued"].get(name, 0))) for o in busy
            ]
