"""The instance API (admin keys only): list, inspect, start and drain model instances."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmserver.api.access import Access, body_of, router
from llmserver.api.deps import speed, supervisor, validate

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
