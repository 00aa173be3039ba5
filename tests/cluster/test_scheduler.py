"""The scheduler's rules (cluster/scheduler.py `plan`), on states written out: placement by room and
spread, labels, a node that cannot run a model, on demand, eviction of idle instances only, idling
down, a node that is gone, cordoned and draining nodes, moves started before they stop, rebalancing."""

from __future__ import annotations

from typing import Any

from llmserver.cluster.scheduler import InstanceView, Model, NodeView, Plan, plan


def model(name: str, revision: int = 1, **config: Any) -> Model:
    return Model(
        name=name, config={"name": name, **config}, revision=revision,
        min_instances=config.get("min_instances", 1), max_instances=config.get("max_instances", 1),
        idle_timeout=config.get("idle_timeout", 300.0), node_selector=config.get("node_selector", {}),
        gpu=config.get("n_gpu_layers") not in (None, 0),
    )  # fmt: skip


def node(name: str, budget: int = 1000, **extra: Any) -> NodeView:
    return NodeView(id=name, budget_mb=budget, **extra)


def sized(*names: str, mb: int = 300, revision: int = 1) -> dict[str, dict[str, Any]]:
    return {name: {"revision": revision, "estimate_mb": mb} for name in names}


def test_min_instances_spread_over_the_nodes_with_room() -> None:
    nodes = [node("n1", checks=sized("a")), node("n2", checks=sized("a")), node("n3", 200, checks=sized("a"))]
    decided = plan([model("a", min_instances=2, max_instances=3)], nodes, [], {}, {})
    assert decided.assignments == {"n1": {"a": 1}, "n2": {"a": 1}}  # one each; n3 has no room for 300 MiB
    assert decided.blocked == {}
    # Nothing changes on the next round: what is assigned stays where it is.
    assert plan([model("a", min_instances=2, max_instances=3)], nodes, [], {}, decided.assignments).assignments == (
        decided.assignments
    )


def test_a_gone_node_s_instances_are_placed_again_and_a_node_that_cannot_run_a_model_gets_none() -> None:
    current = {"n1": {"a": 1}, "n2": {"a": 1}}
    missing = {"a": {"revision": 1, "unavailable": "GGUF file not found: /m.gguf"}}
    nodes = [node("n2", checks=sized("a")), node("n3", checks=missing), node("n4", checks=sized("a"))]
    decided = plan([model("a", min_instances=2, max_instances=2)], nodes, [], {}, current)
    assert decided.assignments == {"n2": {"a": 1}, "n4": {"a": 1}}
    assert any("node n1 is gone" in event for event in decided.events)
    alone = plan([model("a", min_instances=1)], [node("n3", checks=missing)], [], {}, {})
    assert alone.assignments == {} and "GGUF file not found" in alone.blocked["a"]


def test_labels_decide_where_a_model_may_run() -> None:
    nodes = [node("cpu", checks=sized("a")), node("gpu", labels={"gpu": "a100"}, checks=sized("a"))]
    decided = plan([model("a", node_selector={"gpu": "a100"})], nodes, [], {}, {})
    assert decided.assignments == {"gpu": {"a": 1}}
    nowhere = plan([model("a", node_selector={"gpu": "h100"})], nodes, [], {}, {})
    assert nowhere.assignments == {} and "node_selector" in nowhere.blocked["a"]


def test_a_waiting_request_starts_one_more_and_never_two_while_one_starts() -> None:
    nodes = [node("n1", checks=sized("b")), node("n2", checks=sized("b"))]
    cold = model("b", min_instances=0, max_instances=2)
    assert plan([cold], nodes, [], {}, {}).assignments == {}
    first = plan([cold], nodes, [], {"b": 3}, {}).assignments
    assert sum(c.get("b", 0) for c in first.values()) == 1
    # Still starting (nothing published yet): no second one, however many wait.
    assert plan([cold], nodes, [], {"b": 9}, first).assignments == first
    (where,) = first
    running = [InstanceView("i1", where, "b", ram_mb=250, in_flight=2)]
    second = plan([cold], nodes, running, {"b": 9}, first).assignments
    assert sum(c.get("b", 0) for c in second.values()) == 2 and len(second) == 2  # spread
    # At max_instances: no more, whatever waits.
    both = [running[0], InstanceView("i2", next(n for n in second if n != where), "b", ram_mb=250, in_flight=2)]
    assert plan([cold], nodes, both, {"b": 9}, second).assignments == second


def test_an_idle_instance_of_another_model_makes_room_but_a_busy_one_never_does() -> None:
    one = [node("n1", 400, checks=sized("a", "b"))]
    models = [model("a", min_instances=1), model("b", min_instances=0)]
    current = {"n1": {"a": 1}}
    idle_a = [InstanceView("a1", "n1", "a", ram_mb=300, idle_seconds=40)]
    decided = plan(models, one, idle_a, {"b": 1}, current)
    assert decided.assignments == {"n1": {"b": 1}}
    assert any("a on n1" in e and "stops to make room for b" in e for e in decided.events)
    busy_a = [InstanceView("a1", "n1", "a", ram_mb=300, in_flight=1)]
    refused = plan(models, one, busy_a, {"b": 1}, current)
    assert refused.assignments == current and "no idle instance of another model" in refused.blocked["b"]
    # Restoring min_instances never stops anything: a comes back once there is room.
    running_b = [InstanceView("b1", "n1", "b", ram_mb=300, idle_seconds=5)]
    assert plan(models, one, running_b, {}, {"n1": {"b": 1}}).assignments == {"n1": {"b": 1}}


def test_idle_instances_go_down_to_min_instances_one_per_round() -> None:
    nodes = [node("n1", checks=sized("a")), node("n2", checks=sized("a"))]
    spare = model("a", min_instances=1, max_instances=2, idle_timeout=60)
    current = {"n1": {"a": 1}, "n2": {"a": 1}}
    instances = [InstanceView("x", "n1", "a", ram_mb=250, idle_seconds=90),
                 InstanceView("y", "n2", "a", ram_mb=250, idle_seconds=30)]  # fmt: skip
    decided = plan([spare], nodes, instances, {}, current)
    assert decided.assignments == {"n2": {"a": 1}}  # the longest idle went
    assert plan([spare], nodes, instances[1:], {}, decided.assignments).assignments == {"n2": {"a": 1}}  # at min


def test_a_model_removed_from_the_catalog_leaves_its_nodes() -> None:
    nodes = [node("n1", checks=sized("a"))]
    decided = plan([], nodes, [], {}, {"n1": {"a": 1}})
    assert decided.assignments == {} and any("left the catalog" in e for e in decided.events)


def test_instances_nodes_run_from_their_own_models_count_and_are_left_alone() -> None:
    nodes = [node("n1", checks=sized("a"))]
    assert plan([model("a", min_instances=2, max_instances=3)], nodes, [], {}, {}, {"a": 2}).assignments == {}
    assert plan([model("a", min_instances=2, max_instances=3)], [], [], {}, {}, {"a": 2}).blocked == {}
    topped = plan([model("a", min_instances=3, max_instances=3)], nodes, [], {}, {}, {"a": 2})
    assert topped.assignments == {"n1": {"a": 1}}


def test_a_model_that_offloads_layers_goes_where_gpu_memory_has_room() -> None:
    checks = {"big": {"revision": 1, "estimate_mb": 300, "gpu_mb": 5000}}
    cpu = node("cpu-only", checks=checks)
    one = node("gpu-a", gpu_budget_mb=8000, checks=checks)
    two = node("gpu-b", gpu_budget_mb=8000, checks=checks)
    offloading = model("big", min_instances=3, max_instances=3, n_gpu_layers="all")
    decided = plan([offloading], [cpu, one, two], [], {}, {})
    assert decided.assignments == {"gpu-a": {"big": 1}, "gpu-b": {"big": 1}}  # 5 GiB each: one per 8 GiB GPU
    assert "no node has GPU memory" in decided.blocked["big"] and "gpu-a 3000 MiB" in decided.blocked["big"]
    assert plan([model("big", n_gpu_layers=0)], [cpu], [], {}, {}).assignments == {"cpu-only": {"big": 1}}


def running(assignments: dict[str, dict[str, int]], **busy: int) -> list[InstanceView]:
    """The instances the nodes publish once every assigned one is up (`busy`: in flight per model)."""
    return [
        InstanceView(f"{node_id}-{name}-{n}", node_id, name, ram_mb=300, in_flight=busy.get(name, 0), idle_seconds=1)
        for node_id, counts in assignments.items() for name, count in counts.items() for n in range(count)
    ]  # fmt: skip


def rounds(models: list[Model], nodes: list[NodeView], decided: Plan, up: bool, **busy: int) -> Plan:
    """The next round, the instances started (`up`) or still starting (what the last round had up)."""
    shown = decided.assignments if up else {n: c for n, c in decided.assignments.items() if n not in decided.leaving}
    instances = running(decided.assignments if up else shown, **busy)
    return plan(models, nodes, instances, {}, decided.assignments, leaving=decided.leaving)


def test_a_cordoned_node_gets_nothing_new_and_keeps_what_it_runs() -> None:
    chat = model("a", min_instances=2, max_instances=2)
    nodes = [node("n1", checks=sized("a")), node("n2", state="cordoned", checks=sized("a")), node("n3", 0)]
    decided = plan([chat], nodes, [], {}, {})
    assert decided.assignments == {"n1": {"a": 2}}  # n2 cordoned, n3 full: both on n1
    kept = plan([chat], nodes, running({"n2": {"a": 2}}), {}, {"n2": {"a": 2}})
    assert kept.assignments == {"n2": {"a": 2}}  # a cordon moves nothing off
    assert (
        "every node that may run it is cordoned or draining (n2 cordoned)"
        in plan([chat], [nodes[1]], [], {}, {}).blocked["a"]
    )


def test_a_draining_node_s_instances_start_elsewhere_before_they_stop_one_at_a_time() -> None:
    chat = model("a", min_instances=2, max_instances=2)
    nodes = [node("n1", state="draining", checks=sized("a")), node("n2", checks=sized("a"))]
    current = {"n1": {"a": 2}}
    first = plan([chat], nodes, running(current, a=1), {}, current)
    # min_instances 2 and none stays: rule 2 starts two on n2 at once; n1's two run until they are up.
    assert first.assignments == {"n1": {"a": 2}, "n2": {"a": 2}}
    assert first.leaving == {"n1": {"a": 2}} and first.draining["n1"] == ["a: waiting for its replacement to start"]
    starting = rounds([chat], nodes, first, up=False, a=1)
    assert starting.assignments == first.assignments  # nothing stops while its replacement starts
    done = rounds([chat], nodes, starting, up=True, a=1)
    assert done.assignments == {"n2": {"a": 2}} and done.leaving == {} and done.draining == {"n1": []}


def test_a_busy_instance_above_min_instances_is_moved_and_an_idle_one_just_stops() -> None:
    spare = model("b", min_instances=0, max_instances=3, idle_timeout=60)
    nodes = [node("n1", state="draining", checks=sized("b")), node("n2", checks=sized("b"))]
    current = {"n1": {"b": 2}}
    moving = plan([spare], nodes, running(current, b=1), {}, current)
    assert moving.assignments == {"n1": {"b": 2}, "n2": {"b": 1}}  # one move at a time
    assert moving.leaving == {"n1": {"b": 1}}
    still = rounds([spare], nodes, moving, up=False, b=1)
    assert still.assignments == moving.assignments and still.leaving == moving.leaving
    second = rounds([spare], nodes, still, up=True, b=1)
    assert second.assignments == {"n1": {"b": 1}, "n2": {"b": 1}}  # the first moved: the next one starts
    third = plan([spare], nodes, running(second.assignments, b=1), {}, second.assignments, leaving=second.leaving)
    assert third.assignments == {"n1": {"b": 1}, "n2": {"b": 2}} and third.leaving == {"n1": {"b": 1}}
    # An idle instance (past idle_timeout) on a draining node, not needed: it stops, nothing replaces it.
    idle = [InstanceView("x", "n1", "b", ram_mb=300, idle_seconds=90), InstanceView("y", "n2", "b", ram_mb=300)]
    gone = plan([spare], nodes, idle, {}, {"n1": {"b": 1}, "n2": {"b": 1}})
    assert gone.assignments == {"n2": {"b": 1}} and gone.leaving == {}


def test_a_drain_with_nowhere_to_go_waits_and_says_why() -> None:
    chat = model("a", min_instances=1, max_instances=1)
    nodes = [node("n1", state="draining", checks=sized("a")), node("n2", 100, checks=sized("a"))]
    current = {"n1": {"a": 1}}
    decided = plan([chat], nodes, running(current), {}, current)
    assert decided.assignments == current  # kept serving: never stopped with no replacement
    assert "a" in decided.blocked and "no node has room" in decided.blocked["a"]


def test_a_node_that_joins_gets_its_share_one_move_per_model_at_a_time() -> None:
    chat = model("a", min_instances=4, max_instances=4)
    one = [node("n1", 2000, checks=sized("a"))]
    alone = plan([chat], one, [], {}, {})
    assert alone.assignments == {"n1": {"a": 4}}
    both = [*one, node("n2", 2000, checks=sized("a"))]
    decided = plan([chat], both, running(alone.assignments), {}, alone.assignments)
    assert decided.assignments == {"n1": {"a": 4}, "n2": {"a": 1}} and decided.leaving == {"n1": {"a": 1}}
    waited = rounds([chat], both, decided, up=False)
    assert waited.assignments == decided.assignments  # one move at a time: nothing more while it starts
    moved = rounds([chat], both, waited, up=True)
    # The first move done (n1's one stopped), the next begins in the same round.
    assert moved.assignments == {"n1": {"a": 3}, "n2": {"a": 2}} and moved.leaving == {"n1": {"a": 1}}
    moved = rounds([chat], both, moved, up=True)
    assert moved.assignments == {"n1": {"a": 2}, "n2": {"a": 2}} and moved.leaving == {}  # even, and it stays so
    assert rounds([chat], both, moved, up=True).assignments == moved.assignments
    # One apart is even enough: a model of three stays two and one.
    three = model("c", min_instances=3, max_instances=3)
    two_one = {"n1": {"c": 2}, "n2": {"c": 1}}
    checked = [node("n1", 2000, checks=sized("c")), node("n2", 2000, checks=sized("c"))]
    assert plan([three], checked, running(two_one), {}, two_one).assignments == two_one


def test_min_instances_lowered_stops_the_idle_ones_above_it_at_once_never_a_busy_one() -> None:
    nodes = [node("n1", checks=sized("a")), node("n2", checks=sized("a")), node("n3", checks=sized("a"))]
    lowered = model("a", min_instances=0, max_instances=3, idle_timeout=300)
    current = {"n1": {"a": 1}, "n2": {"a": 1}, "n3": {"a": 1}}
    instances = [InstanceView("x", "n1", "a", ram_mb=300, idle_seconds=2),
                 InstanceView("y", "n2", "a", ram_mb=300, in_flight=1),
                 InstanceView("z", "n3", "a", ram_mb=300, idle_seconds=5)]  # fmt: skip
    decided = plan([lowered], nodes, instances, {}, current, assigned_min={"a": 3})
    assert decided.assignments == {"n2": {"a": 1}}  # the two idle ones at once (not after idle_timeout)
    # The round after (the nodes assigned the new minimum): the busy one stays until its idle_timeout.
    later = plan([lowered], nodes, instances[1:2], {}, decided.assignments, assigned_min={"a": 0})
    assert later.assignments == {"n2": {"a": 1}}
    # Without a change of min_instances, idle instances above it wait for their idle_timeout as before.
    assert plan([lowered], nodes, instances, {}, current, assigned_min={"a": 0}).assignments == current


def test_a_node_that_holds_the_file_already_is_preferred_once_the_spread_is_even() -> None:
    fetched = {"a": {"revision": 1}}  # a Hugging Face model not downloaded there: fetched before it starts
    held = {"a": {"revision": 1, "held": True, "estimate_mb": 300}}
    nodes = [node("n1", 4000, checks=fetched), node("n2", 1000, checks=held), node("n3", 4000, checks=fetched)]
    one = plan([model("a", min_instances=1)], nodes, [], {}, {})
    assert one.assignments == {"n2": {"a": 1}}  # not n1 or n3, which have more room but no file
    two = plan([model("a", min_instances=2, max_instances=2)], nodes, [], {}, {})
    assert two.assignments == {"n2": {"a": 1}, "n1": {"a": 1}}  # spread first: the second goes where it must fetch
    stale = {"a": {"revision": 0, "held": True}}  # checked for an older revision: not known to hold this one
    assert plan([model("a")], [node("n1", checks=stale), node("n2", 2000)], [], {}, {}).assignments == {"n2": {"a": 1}}


def test_an_instance_an_admin_drained_is_placed_again_on_another_node() -> None:
    """DELETE /api/instances/ID of a scheduled node's instance: the node runs one fewer and says so
    (`released`); its replacement goes to another node, not back to the busy one it left (before: the
    node started it again itself)."""
    nodes = [node("n1", 2000, checks=sized("a")), node("n2", 2000, checks=sized("a"))]
    chat = model("a", min_instances=3, max_instances=3)
    current = {"n1": {"a": 1}, "n2": {"a": 2}}
    drained = {"n2": {"a": {"count_was": 2, "n": 1}}}
    decided = plan([chat], nodes, running(current), {}, current, released=drained)
    assert decided.assignments == {"n1": {"a": 2}, "n2": {"a": 1}}  # n1 and n2 both had one: not n2 again
    # The node's release is taken once: the next round (its count now what the release left) keeps it.
    later = plan([chat], nodes, running(decided.assignments), {}, decided.assignments, released=drained)
    assert later.assignments == decided.assignments
    # A model above its minimum is not replaced: one fewer is what the admin asked for.
    spare = model("b", min_instances=0, max_instances=3)
    only = [node("n1", checks=sized("b"))]
    fewer = plan([spare], only, [], {}, {"n1": {"b": 2}}, released={"n1": {"b": {"count_was": 2, "n": 1}}})
    assert fewer.assignments == {"n1": {"b": 1}}


def test_an_instance_an_admin_drains_that_its_model_needs_moves_started_first() -> None:
    """A node that keeps the instance an admin drained until its count drops (`"move"` in its release): the
    model's only instance (min_instances 1) is replaced on another node first and leaves its node only once
    the replacement is up, as a drained node's instances move (before: its node stopped it at once and the
    model had none until the replacement started)."""
    nodes = [node("n1", 2000, checks=sized("a")), node("n2", 2000, checks=sized("a"))]
    notes = model("a", min_instances=1, max_instances=1)
    current = {"n1": {"a": 1}}
    drained = {"n1": {"a": {"count_was": 1, "n": 1, "move": 1}}}
    first = plan([notes], nodes, running(current), {}, current, released=drained)
    assert first.assignments == {"n1": {"a": 1}, "n2": {"a": 1}} and first.leaving == {"n1": {"a": 1}}
    # While the replacement starts, nothing more moves (the release is still the node's) and n1 keeps it.
    still = plan([notes], nodes, running(current), {}, first.assignments, leaving=first.leaving, released=drained)
    assert still.assignments == first.assignments and still.leaving == first.leaving
    # Up: n1's count drops (the node then drains the very instance the admin named).
    up = plan([notes], nodes, running(first.assignments), {}, first.assignments, leaving=first.leaving,
              released=drained)  # fmt: skip
    assert up.assignments == {"n2": {"a": 1}} and up.leaving == {}
    # Not needed (above min_instances), or nowhere else to go: it stops at once, never placed back on n1.
    spare = model("b", min_instances=1, max_instances=3)
    two = {"n1": {"b": 2}}
    released = {"n1": {"b": {"count_was": 2, "n": 1, "move": 1}}}
    assert plan([spare], nodes, running(two), {}, two, released=released).assignments == {"n1": {"b": 1}}
    alone = plan([notes], nodes[:1], running(current), {}, current, released=drained)
    assert alone.assignments == {} and any("no other node has room" in e for e in alone.events)
