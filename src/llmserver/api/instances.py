"""The instance API (admin keys only): list, inspect, start and drain model instances."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmserver.api.access import Access, body_of, router
from llmserver.api.deps import speed, supervisor, validate
from llmserver.errors import Conflict, InvalidRequest

admin = router(Access.ADMIN)
routers = (admin,)


class StartInstance(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    node: str | None = None  # for a gateway of role `gateway`: the node to start it on (default: the least busy)


@admin.get("/api/instances")
async def list_instances(request: Request) -> dict[str, Any]:
    running, rate = supervisor(request), speed(request)
    summary = [
        {
            "model": name,
            "instances": len(pool.live()),
            "queue_depth": pool.queue_depth,
            "tokens_per_second_5m": rate.recent(name),
            "avg_tokens_per_second": rate.average(name),
            "last_start_failure": pool.last_start_failure,  # on this host (a node's: GET /api/models/{name})
        }
        for name, pool in running.pools.items()
    ]
    return {"object": "list", "data": [i.describe() for i in running.all_instances()], "models": summary}


@admin.get("/api/instances/{instance_id}")
async def get_instance(request: Request, instance_id: str) -> dict[str, Any]:
    return supervisor(request).find(instance_id).describe()


MAX_LOG_LINES = 1000


@admin.get("/api/instances/{instance_id}/log")
async def instance_log(request: Request, instance_id: str, lines: int = 100) -> dict[str, Any]:
    """The last `lines` (1 to 1,000; at most the file's last 256 KiB) of an instance's llama-server log,
    keys and tokens masked; for instances this server runs (a node's log is on the node's host)."""
    if not 1 <= lines <= MAX_LOG_LINES:
        raise InvalidRequest(f"lines: from 1 to {MAX_LOG_LINES:,}", param="lines")
    instance = supervisor(request).find(instance_id)
    if not instance.log_here:
        raise Conflict(
            f"Instance {instance_id!r} runs on the node {instance.placed_on!r}: its log is a file on that host"
            " (the node's log folder), not here.",
            param="instance_id",
        )
    tail = await asyncio.to_thread(instance.log_tail, lines)
    return {"instance_id": instance.id, "model": instance.model.name, "lines": tail, "path": str(instance.log_path)}


@admin.post("/api/instances", status_code=201, response_model=None)
async def start_instance(request: Request) -> JSONResponse:
    """Start one more instance of a model; answers once it is ready (201) or has failed (502)."""
    body = validate(StartInstance, body_of(request))
    instance = await supervisor(request).start_instance(body.model, body.node)
    return JSONResponse(instance.describe(), status_code=201)


@admin.delete("/api/instances/{instance_id}")
async def drain_instance(request: Request, instance_id: str) -> dict[str, Any]:
    """Drain: no new requests, in-flight ones finish (up to drain_timeout), then the process stops; when
    that would leave its model below min_instances, its replacement is started first."""
    pool = supervisor(request)
    instance = pool.find(instance_id)
    await pool.drain_keeping_min(instance)
    return instance.describe()
