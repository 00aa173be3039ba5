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

Fair shares are bounded in time, not only in count (`fair_slice`): while a key waits holding fewer
than its share of the model's slots (the slots ÷ the keys holding or waiting, at least one), the keys
above theirs give slots back. Their streamed requests still queued in llama-server go first (they have
lost nothing, and would start before the waiting one), then those that have run at least `fair_slice`
seconds, the longest-running first: each is stopped (`Turn`), waits again at the head of its key's
queue, and goes on from where it stopped once a slot is its again (engine/resume.py). So another key's
request starts within about `fair_slice` seconds plus one token, however long the generations that
hold the slots; a key alone still gets every slot. Keys are compared within one gateway; between
gateways that share instances (`gateways_elsewhere`, from their published loads) the same holds per
gateway: while another gateway waits below its share of the slots, this one gives back its streams'
slots beyond its own the same way and takes no place meanwhile, and a gateway waiting below its share
takes free slots only. A request that is not a
resumable stream (one answered whole, or with tools, a schema or logprobs) keeps its slot to its end.

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
class Turn:
    """A streamed request that can give its slot back and go on once it has one again."""

    key_id: str
    stop: Callable[[], None]  # ends its call to the instance now (the relay then waits again)
    running: bool = False  # llama-server began it; else it waits in llama-server's own queue
    since: float = field(default_factory=time.monotonic)  # when it last began to run
    asked: bool = False  # told to give its slot back


@dataclass(eq=False)
class _Waiter:
    key_id: str
    affinity: str | None
    future: asyncio.Future[Instance]
    # A retry waits for a slot elsewhere: the instance it failed on may be dead and not yet reaped
    # (its sockets close a moment before its process can be waited for).
    avoid: Instance | None = None
    resumed: bool = False  # it gave its slot back (Turn): it takes a free slot only, no queue place
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
        fair_slice: float = 0.0,
    ) -> None:
        self.config = config
        # Seconds a streamed request runs before it may be asked to give its slot to a key below its
        # share (0: never; module docstring).
        self.fair_slice = fair_slice
        self._turns: set[Turn] = set()
        self._leaving: set[Turn] = set()  # asked to give their slot back, not yet released: not counted as held
        self._rebalancing: asyncio.TimerHandle | None = None
        self.yields = 0  # slots given back to keys below their share
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
        # Each other gateway that holds places on these instances or has requests waiting for this model:
        # (places it holds, requests it has waiting) — fair shares between gateways in time (fair_slice).
        self.gateways_elsewhere: list[tuple[int, int]] = []
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

    def _free_instance(
        self, affinity: str | None = None, avoid: Instance | None = None, slot_only: bool = False
    ) -> Instance | None:
        """The instance for a request now (None: it waits); `slot_only`: only where a slot is free, not a
        place in an instance's queue (a request that gave its slot back: queued there, it would take the
        slot it gave up before the request it gave it to has reached llama-server)."""
        if self.share is not None and sum(i.in_flight for i in self.instances) >= self.share:
            return None  # other gateways' requests are waiting: leave them the slots this one frees
        if self.gateways_elsewhere and self._owes_gateways():
            return None  # ... and in time: a gateway below its share of the slots waits for those given back
        accepting = [i for i in self.instances if i.accepting]
        if avoid is not None and len(accepting) > 1:  # a retry goes elsewhere when it can: another node's first
            elsewhere = [i for i in accepting if i.placed_on != avoid.placed_on] if avoid.placed_on else []
            accepting = elsewhere or [i for i in accepting if i is not avoid]
        if len(accepting) == 1:  # the usual case: nothing to choose
            only = accepting[0]
            return only if only.load < (only.model.parallel if slot_only else only.model.most_in_flight) else None
        by_address = {i.address: i for i in accepting}
        # A free slot if there is one; else a place in an instance's own queue.
        chosen = choose(
            affinity, [Candidate(a, i.load, i.model.parallel) for a, i in by_address.items()], self.affinity_margin
        )
        if chosen is None and not slot_only:
            candidates = [Candidate(a, i.load, i.model.most_in_flight) for a, i in by_address.items()]
            chosen = choose(affinity, candidates, self.affinity_margin)
        return by_address[chosen.address] if chosen is not None else None

    async def acquire(
        self, key_id: str, affinity: str | None = None, avoid: Instance | None = None, resumed: bool = False
    ) -> Instance:
        """A slot on an instance, counted as in flight for `key_id` until `release`; with an
        affinity key, on the instance that key prefers unless the load guard says otherwise; not on
        `avoid` (the instance a retried request just failed on) while another one is accepting.
        `resumed`: a request that gave its slot back (`Turn`) waits again, first among its key's
        requests, beyond the queue's bound and without its timeout (it was admitted long ago)."""
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
        instance = self._free_instance(affinity, avoid, self._slot_only(key_id, resumed))
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
        if waiting >= self.config.max_queue and not resumed:
            raise _because("queue_full", Overloaded(
                f"The model {self.name!r} is at capacity: all slots are busy and {waiting} requests "
                "are already waiting. Retry shortly.",
                retry_after=2,
            ))  # fmt: skip
        waiter = _Waiter(key_id, affinity, asyncio.get_running_loop().create_future(), avoid, resumed)
        if resumed:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self.on_load()
        self._on_pressure(self)
        if self._turns:
            self.rebalance()
        try:
            async with asyncio.timeout(None if resumed else self.queue_timeout):
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
        for instance in self.instances:  # loops, not any() over generators: on every request's release
            if key_id in instance.users:
                return True
        return bool(self._waiters) and any(waiter.key_id == key_id for waiter in self._waiters)

    def offer(self, turn: Turn) -> None:
        """A streamed request that can give its slot back (again: it began to run)."""
        self._turns.add(turn)
        if self._waiters or self.gateways_elsewhere:
            self.rebalance()

    def withdraw(self, turn: Turn) -> None:
        self._turns.discard(turn)
        self._leaving.discard(turn)

    def _shares(self, key_id: str | None = None) -> tuple[collections.Counter[str], int]:
        """The places each key holds, and a key's share of the slots: the slots ÷ the keys holding or
        waiting (and `key_id`), at least one; 0 when there is nothing to share (one key, no slot)."""
        held: collections.Counter[str] = collections.Counter()
        for instance in self.instances:
            held.update(instance.users)
        held.subtract(turn.key_id for turn in self._leaving)  # on their way out
        keys = (+held).keys() | {w.key_id for w in self._waiters}
        if key_id is not None:
            keys.add(key_id)
        slots = sum(i.model.parallel for i in self.instances if i.accepting)
        return held, (max(1, slots // len(keys)) if len(keys) > 1 and slots else 0)

    def _slot_only(self, key_id: str, resumed: bool) -> bool:
        """Whether a request takes a free slot only, never a place in an instance's queue: one that gave its
        slot back (queued there, it would take the slot it gave up before the request it gave it to reached
        llama-server), and one that slots are being given back to — by a key of this gateway above its share,
        or by another gateway above its own (`_gateway_share`)."""
        if resumed or self._yielded_to(key_id):
            return True
        if not self.gateways_elsewhere:
            return False  # (the usual case: `_gateway_share` is 0)
        share = self._gateway_share(waiting_here=True)
        return bool(share) and any(held > share for held, _ in self.gateways_elsewhere)

    def _gateway_share(self, waiting_here: bool = False) -> int:
        """While other gateways' requests wait for this model (or this gateway's, `waiting_here`), each
        gateway's share of its slots: the slots ÷ the gateways holding or waiting, at least one; else 0."""
        if not self.fair_slice or not self.gateways_elsewhere:
            return 0
        if not waiting_here and not any(waiting for _, waiting in self.gateways_elsewhere):
            return 0
        slots = sum(i.model.parallel for i in self.instances if i.accepting)
        return max(1, slots // (1 + len(self.gateways_elsewhere))) if slots else 0

    def _owed_to_gateways(self) -> tuple[int, int]:
        """This gateway's share of the slots while others wait (0: nobody waits elsewhere) and how many places
        the gateways below theirs wait for."""
        share = self._gateway_share()
        if not share:
            return 0, 0
        return share, sum(min(waiting, share - held) for held, waiting in self.gateways_elsewhere if held < share)

    def _owes_gateways(self) -> bool:
        """Other gateways below their share of the slots wait, and this one holds its share: it takes no
        more places meanwhile."""
        share, wanted = self._owed_to_gateways()
        return wanted > 0 and self._held_here() >= share

    def _held_here(self) -> int:
        """The places this gateway holds on the model's instances, less those asked back."""
        return sum(i.in_flight for i in self.instances) - len(self._leaving)

    def _yielded_to(self, key_id: str) -> bool:
        """Whether a request of `key_id`, below its share while keys above theirs hold slots they can give
        back, takes a free slot only: in an instance's queue it would wait behind their generations (and,
        its slot pinned, perhaps not on the slot given back)."""
        if not self.fair_slice or not self._turns:
            return False
        held, share = self._shares(key_id)
        return bool(share) and held[key_id] < share and any(held[turn.key_id] > share for turn in self._turns)

    def rebalance(self) -> None:
        """Ask streamed requests of keys above their share of the slots to give slots back while keys
        below theirs wait, and of this gateway while other gateways below theirs wait (module docstring);
        if those that may give one back have not yet run for `fair_slice` seconds, look again when the
        first of them has."""
        if self._rebalancing is not None:
            self._rebalancing.cancel()
            self._rebalancing = None
        if not self.fair_slice or not self._turns:
            return
        due = [when for when in (self._rebalance_keys(), self._rebalance_gateways()) if when is not None]
        if due:
            self._rebalancing = asyncio.get_running_loop().call_later(min(due) - time.monotonic(), self.rebalance)

    def _rebalance_gateways(self) -> float | None:
        """Between gateways: this one's turns beyond its share, while others below theirs wait (those still
        queued in llama-server first); when to look again, if some may give a slot back only later."""
        share, wanted = self._owed_to_gateways()
        if min(wanted, self._held_here() - share) <= 0:
            return None
        for turn in [turn for turn in self._turns if not turn.running]:
            self._ask(turn)  # still in llama-server's queue: it would start before the waiting one
        excess = min(wanted, self._held_here() - share)
        for turn in sorted(self._turns, key=lambda t: t.since):
            if excess <= 0:
                return None
            if turn.since + self.fair_slice > time.monotonic():
                return turn.since + self.fair_slice
            self._ask(turn)
            excess -= 1
        return None

    def _rebalance_keys(self) -> float | None:
        """Between this gateway's keys (`rebalance`)."""
        if not self._waiters:
            return None
        waiting = collections.Counter(w.key_id for w in self._waiters if not w.future.done())
        held, share = self._shares()
        if not share:
            return None
        need = sum(min(count, share - held[key]) for key, count in waiting.items() if held[key] < share)
        if need <= 0:
            return None
        over = [turn for turn in self._turns if not turn.asked and held[turn.key_id] > share]
        for turn in over:
            if not turn.running:  # still in llama-server's queue: it would start before the waiting one
                self._ask(turn)
                held[turn.key_id] -= 1
        now, later = time.monotonic(), None
        for turn in sorted((t for t in over if t.running), key=lambda t: t.since):
            if need <= 0:
                break
            if held[turn.key_id] <= share:
                continue
            due = turn.since + self.fair_slice
            if due > now:
                later = due if later is None else min(later, due)
                continue
            self._ask(turn)
            held[turn.key_id] -= 1
            need -= 1
        return later if need > 0 else None

    def _ask(self, turn: Turn) -> None:
        turn.asked = True
        self._turns.discard(turn)
        self._leaving.add(turn)
        self.yields += 1
        turn.stop()

    def close(self, error: APIError) -> None:
        """The model is gone (removed from the catalog): every waiting request fails with `error`."""
        if self._rebalancing is not None:
            self._rebalancing.cancel()
            self._rebalancing = None
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
            instance = self._free_instance(
                waiter.affinity, waiter.avoid, self._slot_only(waiter.key_id, waiter.resumed)
            )
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
