"""The scheduler: which node runs how many instances of which model, for every gateway at once.

Exactly one gateway of role `gateway` schedules at a time: the holder of the `scheduler` lease in the
database (`CatalogStore.lease_take`, on the database's clock, renewed every `TICK`); when it stops
renewing (a kill, a lost host), another gateway takes the lease over once it lapses
(`scheduler_lease_seconds`). Each tick the leader reads the model catalog (its own gateway's copy),
the nodes that take assignments (their records in Redis: labels, memory budget, and per model of the
catalog whether its file is there and what an instance is estimated to take), the instances they
publish, and the requests waiting at every gateway (their loads), and writes each node its
assignment: `llmserver:assign:NODE` → `{"models": {NAME: {"count": N, "config": {...}, "revision": R}}}`.
A node (`Assignments` below, in `llmserver node`) runs exactly that: a model's instances started up
to its count, drained down to it, and rolled over one at a time when the config's revision changes.

The rules, in order, each tick (`plan`, a pure function):
1. A node that stopped publishing (its record lapsed) loses its assignment; so does a model the
   catalog no longer has, or one the node says it cannot run (its file is missing there).
2. Each model gets at least `min_instances`, placed where the memory budget has room; and one more,
   up to `max_instances`, while requests for it wait at any gateway and none of its instances is still
   starting (on demand, from zero too).
3. Where no node has room for a model with requests waiting, the least recently used idle instances
   of other models (nothing in flight, nothing waiting for them) on one node are stopped to make it;
   never a busy one. Restoring `min_instances` never stops anything.
4. An instance idle for its model's `idle_timeout` goes, down to `min_instances`, one per tick; in the
   round that sees `min_instances` lowered, every instance above it with nothing in flight goes at once.
5. A node is chosen among those whose labels hold the model's `node_selector` and whose file check
   passed and that no operator cordoned or drains: the fewest instances of that model first
   (spreading them), then one that holds the file already (a Hugging Face model not downloaded there
   is fetched before its instance starts), then the most free memory. Memory is the node's budget
   less what its assignment is expected to take: each model's largest measured RSS, else the node's
   estimate from the GGUF file (catalog.estimate_mb).
6. Moves, one per model at a time, always started before stopped: an instance on a draining node
   (`llmserver nodes drain`) that is in use or needed for `min_instances` gets a replacement on another
   node, and goes once its model has nothing starting (an idle one goes at once); and when a model's
   instances are uneven over the nodes that may run it (a node joined, came back or was uncordoned:
   one has two more than another with room), one of the fuller node's is moved there the same way.
   The instances being replaced are written in their node's assignment (`leaving`) for the next round.
   An instance an admin drains (DELETE /api/instances/ID: its node says so, `released`) is moved the
   same way when its model needs it for `min_instances` and another node has room; otherwise its node's
   count is lowered at once and it goes.
What could not be placed, and why, is written to `llmserver:schedule` for every gateway: a request
that waits for such a model ends in 503 with that reason (pool.blocked).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmserver.cluster.records import ASSIGN_KEY, KEY, LOAD_KEY, NODE_KEY, STATUS_KEY, scan_json
from llmserver.outage import redis_unreachable

if TYPE_CHECKING:
    import redis.asyncio

    from llmserver.store import CatalogEntry, CatalogStore

log = logging.getLogger("llmserver.pool.scheduler")  # its name before the move: log_levels name it

LEASE = "scheduler"
TICK = 1.0
UNKNOWN_ESTIMATE_MB = 1024  # a model no node could size yet (a Hugging Face file not downloaded)


@dataclass(frozen=True)
class Model:
    """A catalog model, as the scheduler needs it."""

    name: str
    config: dict[str, Any]
    revision: int
    min_instances: int = 1
    max_instances: int = 1
    idle_timeout: float = 300.0
    node_selector: dict[str, str] = field(default_factory=dict)
    gpu: bool = False  # it sets n_gpu_layers (not 0): it needs a node with GPU memory for it

    @classmethod
    def of(cls, entry: CatalogEntry) -> Model:
        config: dict[str, Any] = entry.settings()
        return cls(
            name=entry.name,
            config=config,
            revision=entry.revision,
            min_instances=int(config.get("min_instances", 1)),
            max_instances=int(config.get("max_instances", 1)),
            idle_timeout=float(config.get("idle_timeout", 300.0)),
            node_selector=dict(config.get("node_selector") or {}),
            gpu=config.get("n_gpu_layers") not in (None, 0),
        )


@dataclass(frozen=True)
class NodeView:
    """A node that takes assignments, from its record."""

    id: str
    budget_mb: int
    labels: dict[str, str] = field(default_factory=dict)
    gpu_budget_mb: int = 0
    state: str = "ready"  # or an operator's mark: `cordoned` (no new placements), `draining` (moved off)
    # Per catalog model (name → revision checked, and an estimate in MiB or why it cannot run there).
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def cannot_run(self, model: Model) -> str | None:
        check = self.checks.get(model.name)
        if check is None or check.get("revision") != model.revision:
            return None  # not checked yet: assume it can (a start that fails is reported and moved)
        unavailable = check.get("unavailable")
        return str(unavailable) if unavailable else None

    def holds(self, model: Model) -> bool:
        """Whether its file for `model` is here already (nothing to download before an instance starts)."""
        check = self.checks.get(model.name) or {}
        return bool(check.get("held")) and check.get("revision") == model.revision

    def estimate(self, model: Model, what: str = "estimate_mb") -> int | None:
        check = self.checks.get(model.name) or {}
        value = check.get(what)
        return int(value) if isinstance(value, int | float) and check.get("revision") == model.revision else None


@dataclass(frozen=True)
class InstanceView:
    id: str
    node: str
    model: str
    ram_mb: int = 0
    in_flight: int = 0
    idle_seconds: float = 0.0
    ready: bool = True


@dataclass
class Plan:
    assignments: dict[str, dict[str, int]]
    blocked: dict[str, str]
    events: list[str]
    # Per node, per model: how many of its instances have a replacement starting elsewhere (rule 6).
    leaving: dict[str, dict[str, int]] = field(default_factory=dict)
    # Per draining node: what its drain waits for (nothing: drained once its assignment is empty).
    draining: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class _Ledger:
    """The assignments being planned, and the memory each node's assignment is expected to take."""

    nodes: dict[str, NodeView]
    assign: dict[str, dict[str, int]]
    sizes: dict[str, int]  # RAM one instance takes, per model
    gpu_sizes: dict[str, int]  # GPU memory one instance takes, per model that offloads layers
    planned: dict[str, int] = field(default_factory=dict)
    planned_gpu: dict[str, int] = field(default_factory=dict)
    avoid: set[tuple[str, str]] = field(default_factory=set)  # (node, model): an admin just drained one there
    # (node, model): an admin's drain there stops one this round: none placed there again before the next
    barred: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        for node_id, counts in self.assign.items():
            self.planned[node_id] = sum(self.sizes.get(name, UNKNOWN_ESTIMATE_MB) * n for name, n in counts.items())
            self.planned_gpu[node_id] = sum(self.gpu_sizes.get(name, 0) * n for name, n in counts.items())

    def count(self, node_id: str, name: str) -> int:
        return self.assign.get(node_id, {}).get(name, 0)

    def total(self, name: str) -> int:
        return sum(counts.get(name, 0) for counts in self.assign.values())

    def give(self, node_id: str, name: str) -> None:
        self.assign[node_id][name] = self.count(node_id, name) + 1
        self.planned[node_id] += self.sizes.get(name, UNKNOWN_ESTIMATE_MB)
        self.planned_gpu[node_id] += self.gpu_sizes.get(name, 0)

    def take(self, node_id: str, name: str) -> None:
        self.assign[node_id][name] -= 1
        self.planned[node_id] -= self.sizes.get(name, UNKNOWN_ESTIMATE_MB)
        self.planned_gpu[node_id] -= self.gpu_sizes.get(name, 0)
        if not self.assign[node_id][name]:
            del self.assign[node_id][name]

    def free(self, node: NodeView) -> int:
        return node.budget_mb - self.planned[node.id]

    def fits(self, model: Model, node: NodeView) -> bool:
        """Whether `node` may run `model` at all: its labels, its file check, GPU memory for an offloading one."""
        labels_hold = all(node.labels.get(k) == v for k, v in model.node_selector.items())
        gpu_room = not model.gpu or node.gpu_budget_mb - self.planned_gpu[node.id] >= self.gpu_sizes[model.name]
        return node.state == "ready" and labels_hold and gpu_room and node.cannot_run(model) is None

    def room_for(self, model: Model, but: str | None = None) -> list[NodeView]:
        """The nodes where one more instance of `model` may start now (`but` one)."""
        need = self.sizes[model.name]
        return [
            n for n in self.nodes.values()
            if n.id != but and (n.id, model.name) not in self.barred and self.fits(model, n) and self.free(n) >= need
        ]  # fmt: skip

    def emptiest(self, model: Model, candidates: list[NodeView]) -> NodeView:
        return min(
            candidates,
            key=lambda n: (
                (n.id, model.name) in self.avoid, self.count(n.id, model.name), not n.holds(model), -self.free(n), n.id
            ),
        )  # fmt: skip


def plan(
    models: list[Model],
    nodes: list[NodeView],
    instances: list[InstanceView],
    queued: dict[str, int],
    current: dict[str, dict[str, int]],
    unscheduled: dict[str, int] | None = None,
    leaving: dict[str, dict[str, int]] | None = None,
    assigned_min: dict[str, int] | None = None,
    released: dict[str, dict[str, dict[str, int]]] | None = None,
) -> Plan:
    """The assignments that follow from the state given, by the rules in this module's docstring.
    `unscheduled`: instances per model that nodes run from their own [[models]] (they count toward
    min_instances and max_instances; the scheduler neither places nor stops them). `leaving`: the last
    round's `Plan.leaving` (moves under way). `assigned_min`: each model's min_instances as its nodes
    were last assigned (a lower one in the catalog now stops idle instances above it at once).
    `released`: per node and model, instances an admin drained there (`{"count_was", "n", "move"}`, from the
    node's record): moved (rule 6) where the model needs them, else that node's count lowered by them at once
    (always, for a node that sends no "move": it stops them itself); never placed back on that node."""
    unscheduled = unscheduled or {}
    by_name = {m.name: m for m in models}
    live = {n.id: n for n in nodes}
    events: list[str] = []
    blocked: dict[str, str] = {}
    assign: dict[str, dict[str, int]] = {node_id: {} for node_id in live}
    avoid: set[tuple[str, str]] = set()
    moving: dict[tuple[str, str], int] = {}  # instances an admin drained that their node keeps until told
    for node_id, counts in current.items():
        if node_id not in live:
            if counts:
                events.append(f"node {node_id} is gone: its instances ({_counts(counts)}) are placed again")
            continue
        for name, count in counts.items():
            model = by_name.get(name)
            why = live[node_id].cannot_run(model) if model is not None else None
            if model is None:
                events.append(f"{name} left the catalog: its instances on {node_id} go")
            elif why:
                events.append(f"{name} cannot run on {node_id} ({why}): placed elsewhere")
            elif count > 0:
                drained = (released or {}).get(node_id, {}).get(name)
                if drained and int(drained["count_was"]) == count:
                    avoid.add((node_id, name))
                    if drained.get("move"):
                        moving[(node_id, name)] = int(drained["n"])
                    else:
                        count -= int(drained["n"])
                        events.append(
                            f"{name}: {drained['n']} drained on {node_id} by an admin: placed elsewhere if need be"
                        )
                if count > 0:
                    assign[node_id][name] = count

    sizes: dict[str, int] = {}  # per model: its largest measured RSS, else the first node's estimate
    for instance in instances:
        sizes[instance.model] = max(sizes.get(instance.model, 0), instance.ram_mb)
    for model in models:
        if not sizes.get(model.name):
            sized = (n.estimate(model) for n in live.values())
            sizes[model.name] = next((s for s in sized if s), UNKNOWN_ESTIMATE_MB)
    # GPU memory, for the models that offload layers (n_gpu_layers): the nodes' estimates, else their RAM's.
    gpu_sizes = {
        m.name: next((s for s in (n.estimate(m, "gpu_mb") for n in live.values()) if s), sizes[m.name])
        for m in models if m.gpu
    }  # fmt: skip
    ledger = _Ledger(live, assign, sizes, gpu_sizes, avoid=avoid)
    moves = _Moves(ledger, instances, leaving or {}, events)
    for (node_id, name), count in sorted(moving.items()):
        moves.release(by_name[name], node_id, count, unscheduled.get(name, 0))

    published: Counter[tuple[str, str]] = Counter((i.node, i.model) for i in instances)
    for model in sorted(models, key=lambda m: m.name):
        starting = sum(max(0, ledger.count(n, model.name) - published[(n, model.name)]) for n in assign)
        total = ledger.total(model.name) - moves.going(model)  # the instances that stay
        static = unscheduled.get(model.name, 0)
        want = max(total, model.min_instances - static)
        waiting = queued.get(model.name, 0)
        if waiting and starting == 0 and total + static < model.max_instances:
            want = max(want, total + 1)
        want = max(0, min(want, model.max_instances - static))
        # Rule 4: idle instances above min_instances go, the longest idle first, one per tick; all those
        # with nothing in flight at once when min_instances was just lowered.
        if (assigned_min or {}).get(model.name, 0) > model.min_instances and want == total and not waiting:
            unused = sorted(
                (
                    i for i in instances
                    if i.model == model.name and i.in_flight == 0 and ledger.count(i.node, model.name) > 0
                ),
                key=lambda i: -i.idle_seconds,
            )  # fmt: skip
            for instance in unused[: max(0, total + static - model.min_instances)]:
                ledger.take(instance.node, model.name)
                events.append(f"{model.name}: min_instances lowered to {model.min_instances}: idle one on "
                              f"{instance.node} stops now")  # fmt: skip
                total -= 1
            moves.settle(model, starting, total, total, 0)
            continue
        if want == total and total + static > model.min_instances and not waiting:
            idle = [
                i for i in instances
                if i.model == model.name and i.in_flight == 0 and i.idle_seconds >= model.idle_timeout
                and ledger.count(i.node, model.name) > moves.replaced(i.node, model)
            ]  # fmt: skip
            if idle:
                longest = max(idle, key=lambda i: i.idle_seconds)
                ledger.take(longest.node, model.name)
                events.append(f"{model.name} on {longest.node} idle for {longest.idle_seconds:.0f} s: stopping one")
                moves.settle(model, starting, want, total - 1, 0)
                continue
        while total > want:  # max_instances lowered: from the node with the most of it
            node_id = max(
                (n for n in assign if not moves.draining(n) and ledger.count(n, model.name) > moves.replaced(n, model)),
                key=lambda n: (ledger.count(n, model.name), n),
            )
            ledger.take(node_id, model.name)
            total -= 1
        placed = 0
        while total < want:
            candidates = ledger.room_for(model)
            if candidates:
                chosen = ledger.emptiest(model, candidates)
                ledger.give(chosen.id, model.name)
                events.append(f"{model.name}: one more instance on {chosen.id} ({total + 1} of {want})")
                total, placed = total + 1, placed + 1
                continue
            if waiting and _evict(model, ledger, instances, queued, events):
                total, placed = total + 1, placed + 1
                continue
            blocked[model.name] = _why_not(model, ledger)
            break
        moves.settle(model, starting, want, total, placed)
    return Plan(
        {n: counts for n, counts in assign.items() if counts}, blocked, events, moves.leaving_now(), moves.waits
    )


class _Moves:
    """Rule 6: instances that leave a node — all of a draining node's, and one of a node with too many of
    a model — each replaced elsewhere first where it is worth it, and stopped once the replacement is up."""

    def __init__(
        self, ledger: _Ledger, instances: list[InstanceView], leaving: dict[str, dict[str, int]], events: list[str]
    ) -> None:
        self.ledger = ledger
        self.instances = instances
        self.events = events
        # Per node and model: replacements placed (in earlier rounds or this one) for instances there.
        self._replaced = {
            (node_id, name): count for node_id, counts in leaving.items() for name, count in counts.items()
            if node_id in ledger.nodes and count > 0
        }  # fmt: skip
        self.waits: dict[str, list[str]] = {n.id: [] for n in ledger.nodes.values() if n.state == "draining"}

    def draining(self, node_id: str) -> bool:
        return self.ledger.nodes[node_id].state == "draining"

    def replaced(self, node_id: str, model: Model) -> int:
        return min(self._replaced.get((node_id, model.name), 0), self.ledger.count(node_id, model.name))

    def going(self, model: Model) -> int:
        """The instances of `model` that leave their node: a draining node's all, elsewhere those replaced."""
        return sum(
            self.ledger.count(n, model.name) if self.draining(n) else self.replaced(n, model)
            for n in self.ledger.assign
        )

    def settle(self, model: Model, starting: int, want: int, staying: int, placed: int) -> None:
        """After the round's other rules (which placed `placed` more of `model`, `staying` of it now
        staying): stop what was replaced once nothing of the model starts, then start at most one
        replacement while nothing of it starts. What rule 2 just placed replaces a draining node's first."""
        ledger, name = self.ledger, model.name
        starting += placed
        for node_id in ledger.assign:
            while placed and self.draining(node_id) and ledger.count(node_id, name) > self.replaced(node_id, model):
                self._replaced[(node_id, name)] = self._replaced.get((node_id, name), 0) + 1
                placed -= 1
        for node_id in list(ledger.assign):
            count, replaced = ledger.count(node_id, name), self.replaced(node_id, model)
            if not count:
                self._replaced.pop((node_id, name), None)
                continue
            if replaced and starting == 0:
                for _ in range(replaced):
                    ledger.take(node_id, name)
                self._replaced.pop((node_id, name), None)
                self.events.append(f"{name}: {replaced} on {node_id} replaced elsewhere, stopping")
                continue
            if not self.draining(node_id):
                continue
            if count <= replaced:
                self.waits[node_id].append(f"{name}: waiting for its replacement to start")
                continue
            # A draining node's instances not replaced yet: an idle one that is not needed goes at once.
            idle = [
                i for i in self.instances
                if i.node == node_id and i.model == name and i.in_flight == 0 and i.idle_seconds >= model.idle_timeout
            ]  # fmt: skip
            if idle and staying >= max(want, model.min_instances):
                ledger.take(node_id, name)
                self.events.append(f"{name} on draining {node_id}: idle and not needed, stopping")
                continue
            if starting:
                self.waits[node_id].append(f"{name}: waiting for its replacement to start")
                return
            candidates = ledger.room_for(model, but=node_id)
            if not candidates:
                self.waits[node_id].append(f"{name}: no other node has room for it ({_why_not(model, ledger)})")
                continue
            self._move(model, node_id, ledger.emptiest(model, candidates))
            return
        if starting or any(self.draining(n) and ledger.count(n, name) for n in ledger.assign):
            return
        # Uneven: a node (not cordoned) with two more than a node with room gives it one.
        sources = [
            n for n in ledger.assign
            if ledger.nodes[n].state == "ready" and ledger.count(n, name) > self.replaced(n, model)
        ]  # fmt: skip
        candidates = [n for n in ledger.room_for(model) if (n.id, name) not in ledger.avoid]
        if not sources or not candidates:
            return
        source = max(sources, key=lambda n: (ledger.count(n, name), n))
        target = ledger.emptiest(model, [c for c in candidates if c.id != source] or candidates)
        if ledger.count(source, name) - ledger.count(target.id, name) >= 2:
            self._move(model, source, target)

    def release(self, model: Model, node_id: str, count: int, static: int) -> None:
        """`count` of `model`'s instances on `node_id` drained by an admin: each one the model needs for
        min_instances is moved to another node with room (started there first: its node keeps it until its
        count drops); the rest go now. Those being moved already (the last rounds') are not moved again."""
        ledger, name = self.ledger, model.name
        for _ in range(count - self.replaced(node_id, model)):
            staying = ledger.total(name) - self.going(model) - 1 + static
            candidates = ledger.room_for(model, but=node_id)
            if staying < model.min_instances and candidates:
                self._move(model, node_id, ledger.emptiest(model, candidates))
                continue
            ledger.take(node_id, name)
            ledger.barred.add((node_id, name))  # its count must drop for its node to stop it
            why = "no other node has room for it" if staying < model.min_instances else "not needed"
            self.events.append(f"{name}: one drained on {node_id} by an admin stops now ({why})")

    def _move(self, model: Model, source: str, target: NodeView) -> None:
        self.ledger.give(target.id, model.name)
        self._replaced[(source, model.name)] = self._replaced.get((source, model.name), 0) + 1
        self.events.append(f"{model.name}: moving one from {source} to {target.id} (started there first)")

    def leaving_now(self) -> dict[str, dict[str, int]]:
        leaving: dict[str, dict[str, int]] = {}
        for (node_id, name), count in self._replaced.items():
            if count > 0 and self.ledger.count(node_id, name):
                leaving.setdefault(node_id, {})[name] = count
        return leaving


def _evict(
    model: Model, ledger: _Ledger, instances: list[InstanceView], queued: dict[str, int], events: list[str]
) -> bool:
    """Rule 3: on the node where it frees enough soonest, stop the longest idle instances of other
    models (nothing in flight, no request waiting for their model) to make room for one of `model`."""
    need = ledger.sizes[model.name]
    for node in sorted(ledger.nodes.values(), key=lambda n: (-ledger.free(n), n.id)):
        if not ledger.fits(model, node):
            continue
        idle = sorted(
            (
                i for i in instances
                if i.node == node.id and i.model != model.name and i.in_flight == 0 and i.ready
                and not queued.get(i.model) and ledger.count(node.id, i.model) > 0
            ),
            key=lambda i: -i.idle_seconds,
        )  # fmt: skip
        room, chosen = ledger.free(node), []
        for instance in idle:
            if room >= need:
                break
            chosen.append(instance)
            room += ledger.sizes.get(instance.model, UNKNOWN_ESTIMATE_MB)
        if room < need:
            continue
        for instance in chosen:
            ledger.take(node.id, instance.model)
            events.append(
                f"{instance.model} on {node.id} (idle {instance.idle_seconds:.0f} s, {instance.ram_mb} MiB) "
                f"stops to make room for {model.name}"
            )
        ledger.give(node.id, model.name)
        events.append(f"{model.name}: one more instance on {node.id}, in the room made")
        return True
    return False


def _why_not(model: Model, ledger: _Ledger) -> str:
    live = ledger.nodes
    if not live:
        return "no node takes assignments (start `llmserver node` with no [[models]] in its config)"
    unable = {n.id: why for n in live.values() if (why := n.cannot_run(model))}
    labelled = [n for n in live.values() if all(n.labels.get(k) == v for k, v in model.node_selector.items())]
    if not labelled:
        return f"no node has the labels its node_selector asks for ({_counts(model.node_selector)})"
    if len(unable) == len(labelled):
        return "no node can run it: " + "; ".join(f"{node}: {why}" for node, why in sorted(unable.items()))
    if all(n.state != "ready" for n in labelled):
        marked = ", ".join(f"{n.id} {n.state}" for n in sorted(labelled, key=lambda n: n.id))
        return f"every node that may run it is cordoned or draining ({marked}): `llmserver nodes uncordon NODE`"
    if model.gpu and not [n for n in labelled if ledger.fits(model, n)]:
        room = ", ".join(f"{n.id} {max(0, n.gpu_budget_mb - ledger.planned_gpu[n.id])} MiB" for n in labelled)
        return f"no node has GPU memory for an instance (~{ledger.gpu_sizes[model.name]} MiB; free: {room})"
    room = ", ".join(f"{n.id} {max(0, ledger.free(n))} MiB" for n in labelled if ledger.fits(model, n))
    return (
        f"no node has room for an instance (~{ledger.sizes[model.name]} MiB; free: {room}) and no idle instance of "
        "another model can be stopped for it"
    )


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counts.items()))


class Scheduler:
    """A gateway's side: it tries for the lease every tick, and while it holds it, schedules."""

    def __init__(
        self,
        store: CatalogStore,
        client: redis.asyncio.Redis,
        gateway_id: str,
        catalog: Any,
        lease_seconds: float,
    ) -> None:
        self._store = store
        self._redis = client
        self._gateway = gateway_id
        self._catalog = catalog  # the gateway's CatalogFollower: `.entries`
        self._lease = lease_seconds
        self._task: asyncio.Task[None] | None = None
        self.leading = False
        self.last_plan: Plan | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.leading:
            with contextlib.suppress(Exception):
                await self._store.lease_release(LEASE, self._gateway)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:
                log.exception("scheduler tick failed")
            await asyncio.sleep(max(0.05, TICK - (time.monotonic() - started)))

    async def tick(self) -> None:
        try:
            leading = await self._store.lease_take(LEASE, self._gateway, self._lease)
        except Exception as exc:  # the database cannot be reached: whoever holds the lease goes on
            leading = False
            log.debug("scheduler lease not renewed: %s", exc)
        if leading != self.leading:
            self.leading = leading
            log.info("gateway %s %s the scheduler", self._gateway, "is now" if leading else "is no longer")
        if not leading:
            return
        try:
            await self.schedule()
        except redis_unreachable() as exc:
            log.warning("scheduler: Redis cannot be reached (%s); assignments stay as they are", exc)

    async def schedule(self) -> Plan:
        """One round: read the state, plan, write what changed."""
        entries = list(self._catalog.entries)
        models = [Model.of(entry) for entry in entries]
        catalog = {m.name: {"config": m.config, "revision": m.revision} for m in models}
        nodes_raw = [n for n in await scan_json(self._redis, NODE_KEY) if n.get("scheduled")]
        marks = {mark.node: mark.state for mark in await self._store.node_marks()}
        nodes = [
            NodeView(
                id=n["node"], budget_mb=int(n.get("memory_budget_mb") or 0), labels=dict(n.get("labels") or {}),
                checks=dict(n.get("checks") or {}), gpu_budget_mb=int(n.get("gpu_budget_mb") or 0),
                state=marks.get(n["node"], "ready"),
            )
            for n in nodes_raw
        ]  # fmt: skip
        scheduled = {n.id for n in nodes}
        records = [r for r in await scan_json(self._redis, KEY) if r.get("status") in ("ready", "busy")]
        instances = [
            InstanceView(
                id=r["instance_id"], node=r["node"], model=r["model"], ram_mb=int(r.get("ram_used_mb") or 0),
                in_flight=int(r.get("in_flight") or 0), idle_seconds=float(r.get("idle_seconds") or 0.0),
            )
            for r in records if r.get("node") in scheduled
        ]  # fmt: skip
        unscheduled = Counter(str(r["model"]) for r in records if r.get("node") not in scheduled)
        queued: Counter[str] = Counter()
        for load in await scan_json(self._redis, LOAD_KEY):
            queued.update(load.get("queued") or {})
        current: dict[str, dict[str, int]] = {}
        leaving: dict[str, dict[str, int]] = {}
        assigned_min: dict[str, int] = {}
        keys = [k async for k in self._redis.scan_iter(match=ASSIGN_KEY + "*", count=500)]
        for key, value in zip(keys, await self._redis.mget(keys) if keys else [], strict=True):
            node_id = (key.decode() if isinstance(key, bytes) else key).removeprefix(ASSIGN_KEY)
            if value:
                assigned = json.loads(value)["models"].items()
                current[node_id] = {name: int(a["count"]) for name, a in assigned}
                leaving[node_id] = {name: int(a["leaving"]) for name, a in assigned if a.get("leaving")}
                for name, a in assigned:
                    assigned_min[name] = max(assigned_min.get(name, 0), int(a["config"].get("min_instances", 1)))
        released = {n["node"]: n["released"] for n in nodes_raw if n.get("released")}
        decided = plan(
            models, nodes, instances, dict(queued), current, dict(unscheduled), leaving, assigned_min, released
        )
        for event in decided.events:
            log.info("scheduler: %s", event)
        pipe = self._redis.pipeline(transaction=False)
        for node_id in current.keys() - decided.assignments.keys():
            pipe.delete(ASSIGN_KEY + node_id)
        for node_id, counts in decided.assignments.items():
            going = decided.leaving.get(node_id, {})
            assignment = {
                "models": {
                    name: {"count": count, **catalog[name], **({"leaving": going[name]} if name in going else {})}
                    for name, count in sorted(counts.items())
                },
                "leader": self._gateway,
            }
            pipe.set(ASSIGN_KEY + node_id, json.dumps(assignment, sort_keys=True))
        status = {
            "leader": self._gateway, "at": time.time(), "catalog": catalog, "blocked": decided.blocked,
            "draining": decided.draining,
        }  # fmt: skip
        pipe.set(STATUS_KEY, json.dumps(status), px=int(max(10.0, self._lease * 2) * 1000))
        await pipe.execute()
        for name, why in decided.blocked.items():
            if self.last_plan is None or self.last_plan.blocked.get(name) != why:
                log.warning("scheduler: %s cannot be placed: %s", name, why)
        self.last_plan = decided
        return decided
