"""One model's instances and the bounded queue of requests waiting for a free slot.

A request takes a slot on the accepting instance with the fewest requests in flight. When every
slot is taken, a place in an instance's own queue (`instance_queue` per instance, as many as its
slots by default): llama-server starts a request it holds the moment a slot frees, in its next
batch, where one sent only then would miss that batch, having to wait for the answer that freed the
slot to reach this gateway (short requests under load: 0.82 x direct llama-server's requests a
second without it, 0.97 x with it, measured on 2 CPUs). When those are taken too, it waits in a
queue of at most `max_queue`; a full queue is 503 at once, and a wait longer than `queue_timeout` is
504. Each released place, and each instance that becomes ready, goes to the waiting key that holds
the fewest of the model's places, then to the key served longest ago (round robin), first come first
served among a key's own requests: one key sending many long requests waits behind its own work, not
in front of everyone else's (inputs/fair.py shares extraction slots the same way). Where several
gateways route to the same instances (nodes' instances, cluster/registry.py), an instance's load counts
every gateway's requests, the queue's bound counts every gateway's waiters, and a gateway whose
requests hold more than its share of the places while others' wait lets the next free one go to them.

The pool's owner (the supervisor) hears of pressure (requests queueing, here or at an instance) and
of instances that requests could not reach through the callbacks it gives.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from llmserver.errors import APIError, GatewayTimeout, Overloaded
from llmserver.pool.affinity import Candidate, choose
from llmserver.pool.instance import Instance, Status
from llmserver.settings import ModelConfig


@dataclass(eq=False)
class _Waiter:
    key_id: str
    affinity: str | None
    future: asyncio.Future[Instance]
    # A retry waits for a slot elsewhere: the instance it failed on may be dead and not yet reaped
    # (its sockets close a moment before its process can be waited for).
    avoid: Instance | None = None
    since: float = field(default_factory=time.monotonic)  # when it began to wait


class ModelPool:
    def __init__(
        self,
        config: ModelConfig,
        *,
        queue_timeout: float,
        on_pressure: Callable[[ModelPool], None],
        on_failure: Callable[[Instance], None] = lambda instance: None,
        affinity_margin: int = -1,
    ) -> None:
        self.config = config
        # Requests with an affinity key go to their instance by rendezvous hashing, within this many
        # requests in flight of the least loaded one (pool/affinity.py); below 0: least loaded only.
        self.affinity_margin = affinity_margin
        self.instances: list[Instance] = []
        self.queue_timeout = queue_timeout
        self._on_pressure = on_pressure
        self._on_failure = on_failure
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._served: dict[str, int] = {}  # key id → when it last got a place (for round robin)
        self._grants = itertools.count()
        # After an instance fails to start, automatic starts wait (doubling) before trying again.
        self.start_backoff = 0.0
        self.next_start_at = 0.0
        # Why the supervisor cannot start an instance now (the memory budget, a failed start), if so.
        self.blocked: str | None = None
        self.measured_mb = 0  # the most RAM one instance was measured to use
        self.cold_starts = 0
        self.cold_start_seconds = 0.0
        self.evictions = 0
        self.stalls = 0  # instances restarted by the watchdog (pool/supervisor.py)
        self.stalls_by_key: collections.Counter[str] = collections.Counter()  # the keys whose requests stalled them
        self.crashes = 0  # instances that died, hung or stalled (each restarted or given up)
        # With other gateways routing to the same instances (role `gateway`, from the registry):
        # the requests they have waiting for this model, and this gateway's fair share of its slots
        # while they have (None: no cap).
        self.queued_elsewhere = 0
        self.share: int | None = None
        # Set by the registry, which publishes this gateway's requests in flight and waiting when
        # they change, and (`load_shared`) awaits the changes made so far reaching the others.
        self.rolling = asyncio.Lock()  # held while the instances roll over to new settings (supervisor)
        # Why no instance can be started at all (its model file cannot be had): requests fail at once.
        self.unstartable: str | None = None
        # Looking for the files again: the wait before the next try (doubling) and when that is.
        self.files_backoff = 0.0
        self.next_files_at = 0.0
        # While its GGUF file downloads here: {"bytes": so far, "total": of how many (None: not known yet)}.
        self.fetching: dict[str, int | None] | None = None
        # min_instances was lowered while an instance started: idle ones above it stop once it is up.
        self.shed_when_started = False
        # The last instance that failed to start here: when, which, why, and the last lines of its log.
        self.last_start_failure: dict[str, object] | None = None
        self.closed: APIError | None = None  # the model was removed: every request fails with this
        self.on_load: Callable[[], None] = lambda: None
        self.load_shared: Callable[[], Awaitable[None]] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def longest_wait(self) -> float:
        """Seconds the longest-waiting request has waited (0 with none waiting)."""
        return time.monotonic() - self._waiters[0].since if self._waiters else 0.0

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def chooses(self) -> bool:
        """Whether a request's affinity key can decide its instance: affinity routing on, and more than
        one instance to choose from, now or later (max_instances; nodes' instances come and go). With
        one for good, the key is not made (hashing the conversation's start: 0.01 ms a request)."""
        return self.affinity_margin >= 0 and (len(self.instances) != 1 or self.config.max_instances > 1)

    @property
    def ready(self) -> bool:
        return any(i.accepting for i in self.instances)

    def live(self) -> list[Instance]:
        """Instances that count toward min/max_instances: all but stopped ones (a given-up one
        stays, failed, until an admin deletes it, so that a crashing model is not started forever)."""
        return [i for i in self.instances if i.status != Status.STOPPED]

    def _free_instance(self, affinity: str | None = None, avoid: Instance | None = None) -> Instance | None:
        if self.share is not None and sum(i.in_flight for i in self.instances) >= self.share:
            return None  # other gateways' requests are waiting: leave them the slots this one frees
        accepting = [i for i in self.instances if i.accepting]
        if avoid is not None and len(accepting) > 1:  # a retry goes elsewhere when it can: another node's first
            elsewhere = [i for i in accepting if i.placed_on != avoid.placed_on] if avoid.placed_on else []
            accepting = elsewhere or [i for i in accepting if i is not avoid]
        if len(accepting) == 1:  # the usual case: nothing to choose
            only = accepting[0]
            return only if only.load < only.model.most_in_flight else None
        by_address = {i.address: i for i in accepting}
        # A free slot if there is one; else a place in an instance's own queue.
        chosen = choose(
            affinity, [Candidate(a, i.load, i.model.parallel) for a, i in by_address.items()], self.affinity_margin
        )
        if chosen is None:
            candidates = [Candidate(a, i.load, i.model.most_in_flight) for a, i in by_address.items()]
            chosen = choose(affinity, candidates, self.affinity_margin)
        return by_address[chosen.address] if chosen is not None else None

    async def acquire(self, key_id: str, affinity: str | None = None, avoid: Instance | None = None) -> Instance:
        """A slot on an instance, counted as in flight for `key_id` until `release`; with an
        affinity key, on the instance that key prefers unless the load guard says otherwise; not on
        `avoid` (the instance a retried request just failed on) while another one is accepting."""
        if self.closed is not None:
            raise type(self.closed)(self.closed.message, param=self.closed.param)
        if self.config.max_instances == 0:
            raise _because("no_instance", Overloaded(
                f"The model {self.name!r} is stopped (max_instances 0): an admin starts it again "
                f"(`llmserver models start {self.name}`, or PATCH /api/models/{self.name}).", retry_after=60
            ))  # fmt: skip
        if self.unstartable is not None and not self.instances:
            raise _because("no_instance", Overloaded(
                f"No instance of {self.name!r} can be started: {self.unstartable}.", retry_after=30
            ))  # fmt: skip
        instance = self._free_instance(affinity, avoid)
        if instance is not None and not self._waiters:
            self._begin(instance, key_id)
            return instance
        if self.instances and all(i.status == Status.FAILED and not i.restarting for i in self.instances):
            # Every instance has failed and been given up: waiting would only end in a timeout. (One that
            # drains, say evicted for another model, is not: a new one is started for the waiting.)
            raise _because("no_instance", Overloaded(
                f"No instance of {self.name!r} is running; see the server's log.", retry_after=30
            ))  # fmt: skip
        waiting = len(self._waiters) + self.queued_elsewhere
        if waiting >= self.config.max_queue:
            raise _because("queue_full", Overloaded(
                f"The model {self.name!r} is at capacity: all slots are busy and {waiting} requests "
                "are already waiting. Retry shortly.",
                retry_after=2,
            ))  # fmt: skip
        waiter = _Waiter(key_id, affinity, asyncio.get_running_loop().create_future(), avoid)
        self._waiters.append(waiter)
        self.on_load()
        self._on_pressure(self)
        try:
            async with asyncio.timeout(self.queue_timeout):
                return await waiter.future
        except BaseException as exc:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self.on_load()
            elif waiter.future.done() and not waiter.future.cancelled():
                # A slot was handed over just as this request gave up: give it back.
                self.release(waiter.future.result(), key_id)
            if isinstance(exc, TimeoutError):
                raise _because("queue_timeout", self._timed_out()) from None
            raise

    def _timed_out(self) -> APIError:
        waited = f"{self.queue_timeout:.0f} s"
        if self.ready:
            return GatewayTimeout(f"No slot of {self.name!r} came free within {waited}; the server is overloaded.")
        if self.blocked:
            return Overloaded(
                f"No instance of {self.name!r} could be started within {waited}: {self.blocked}.", retry_after=30
            )
        return Overloaded(
            f"The instance of {self.name!r} was still starting after {waited}; retry shortly.", retry_after=10
        )

    def release(self, instance: Instance, key_id: str) -> None:
        instance.end(key_id)
        if key_id not in instance.users and not self._holds_or_waits(key_id):
            self._served.pop(key_id, None)  # bounded: only keys holding or waiting are remembered
        self.dispatch()
        self.on_load()

    def _holds_or_waits(self, key_id: str) -> bool:
        return any(key_id in i.users for i in self.instances) or any(w.key_id == key_id for w in self._waiters)

    def close(self, error: APIError) -> None:
        """The model is gone (removed from the catalog): every waiting request fails with `error`."""
        self.closed = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(type(error)(error.message, param=error.param))
        self.on_load()

    def report_failure(self, instance: Instance) -> None:
        """A request could not reach this instance: the pool's owner decides whether it died."""
        self._on_failure(instance)

    def dispatch(self) -> None:
        """Hand free places to waiters, the fairest first (after a release, or when an instance became ready)."""
        while self._waiters:
            waiter = self._next_waiter()
            if waiter.future.done():  # timed out or cancelled meanwhile
                self._waiters.remove(waiter)
                continue
            instance = self._free_instance(waiter.affinity, waiter.avoid)
            if instance is None:
                return
            self._waiters.remove(waiter)
            self._begin(instance, waiter.key_id)
            waiter.future.set_result(instance)

    def _next_waiter(self) -> _Waiter:
        """The oldest request of the waiting key that holds the fewest places here, the key served longest
        ago among equals: one key's backlog never stands in front of another key's request."""
        first = self._waiters[0]
        if len(self._waiters) == 1 or all(w.key_id == first.key_id for w in self._waiters):
            return first
        held: dict[str, int] = {}
        for instance in self.instances:
            for key_id, count in instance.users.items():
                held[key_id] = held.get(key_id, 0) + count
        best, rank = first, (held.get(first.key_id, 0), self._served.get(first.key_id, -1))
        seen = {first.key_id}
        for waiter in self._waiters:
            if waiter.key_id in seen:
                continue
            seen.add(waiter.key_id)
            candidate = (held.get(waiter.key_id, 0), self._served.get(waiter.key_id, -1))
            if candidate < rank:
                best, rank = waiter, candidate
        return best

    def _begin(self, instance: Instance, key_id: str) -> None:
        self._served[key_id] = next(self._grants)
        instance.begin(key_id)
        self.on_load()
        if instance.load > instance.model.parallel:
            self._on_pressure(self)  # requests queue at the instance: every slot is taken


def _because(reason: str, error: APIError) -> APIError:
    error.reason = reason
    return error
