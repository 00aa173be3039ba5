"""The operator's view of the worker nodes and hold on them: `/api/nodes` and `llmserver nodes
list|cordon|uncordon|drain`. A mark (cordoned: no new placements; draining: no new placements and its
instances moved to other nodes, each started elsewhere before it stops) lives in the database, so that
it outlasts a restart of the node, of Redis or of every gateway; the scheduler reads it every round
(cluster/scheduler.py, rules 5 and 6). A node that runs its own [[models]] takes no mark: the
scheduler neither places on it nor moves anything off it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llmserver.cluster.records import ASSIGN_KEY, KEY, NODE_KEY, STATUS_KEY, scan_json
from llmserver.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    import redis.asyncio

    from llmserver.store import CatalogStore

ACTIONS = {"cordon": "cordoned", "drain": "draining", "uncordon": None}


async def describe(client: redis.asyncio.Redis, store: CatalogStore) -> list[dict[str, Any]]:
    """Every node that publishes or carries a mark: its state (`ready`, `cordoned`, `draining`,
    `drained` once nothing is assigned to it and nothing of it runs), what runs there and what its drain
    waits for."""
    records = {n["node"]: n for n in await scan_json(client, NODE_KEY)}
    marks = {m.node: m for m in await store.node_marks()}
    running: dict[str, int] = {}
    for instance in await scan_json(client, KEY):
        if instance.get("status") in ("ready", "busy", "draining", "starting"):
            running[instance["node"]] = running.get(instance["node"], 0) + 1
    status_raw = await client.get(STATUS_KEY)
    waits: dict[str, list[str]] = (json.loads(status_raw).get("draining") or {}) if status_raw else {}
    names = sorted(records.keys() | marks.keys())
    assignments = await client.mget([ASSIGN_KEY + node_id for node_id in names]) if names else []
    described = []
    for node_id, assigned_raw in zip(names, assignments, strict=True):
        record, mark = records.get(node_id, {}), marks.get(node_id)
        given = json.loads(assigned_raw)["models"] if assigned_raw else {}
        assigned = {name: int(model["count"]) for name, model in given.items()}
        state = mark.state if mark is not None else "ready"
        if state == "draining" and not assigned and not running.get(node_id):
            state = "drained"
        described.append({
            "node": node_id,
            "state": state,
            "since": mark.since if mark is not None else None,
            "up": node_id in records,
            "scheduled": bool(record.get("scheduled")),
            "labels": record.get("labels") or {},
            "instances": running.get(node_id, 0),
            "assigned": assigned,
            "models": record.get("models") or [],
            "memory_used_mb": record.get("memory_used_mb"),
            "memory_budget_mb": record.get("memory_budget_mb"),
            "waiting": waits.get(node_id, []) if state == "draining" else [],
        })  # fmt: skip
    return described


async def mark(client: redis.asyncio.Redis, store: CatalogStore, node_id: str, action: str) -> dict[str, Any]:
    """Cordon, drain or uncordon a node; its description after."""
    if action not in ACTIONS:
        raise InvalidRequest(f"Unknown action {action!r}: one of {', '.join(ACTIONS)}.", param="action")
    known = {n["node"]: n for n in await scan_json(client, NODE_KEY)}
    marked = {m.node for m in await store.node_marks()}
    record = known.get(node_id)
    if record is None and node_id not in marked:
        listed = ", ".join(sorted(known)) or "none publishes now"
        raise NotFound(f"No node {node_id!r} publishes in the registry (nodes: {listed}).", param="node")
    if record is not None and not record.get("scheduled") and ACTIONS[action] is not None:
        raise InvalidRequest(
            f"Node {node_id!r} runs its own [[models]]: the scheduler neither places instances on it nor moves "
            "them off it. Stop the node itself (its instances drain), or run it without [[models]].",
            param="node",
        )
    await store.node_mark(node_id, ACTIONS[action])
    for described in await describe(client, store):
        if described["node"] == node_id:
            return described
    return {"node": node_id, "state": "ready", "since": None, "up": False}  # uncordoned, and not publishing
