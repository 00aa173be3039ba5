"""The scheduler's rules (cluster/scheduler.py `plan`), on states written out: placement by room and
spread, labels, a node that cannot run a model, on demand, eviction of idle instances only, idling
down, a node that is gone."""

from __future__ import annotations

from typing import Any

from llmserver.cluster.scheduler import InstanceView, Model, NodeView, plan


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
