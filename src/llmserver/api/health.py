"""Liveness and readiness, open to anyone."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserver.api.deps import supervisor

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> JSONResponse:
    pool = supervisor(request)
    models = {name: model_pool.ready for name, model_pool in pool.pools.items()}
    # A model kept at zero instances (started on its first request) does not hold readiness back.
    ok = all(ready or pool.pools[name].config.min_instances == 0 for name, ready in models.items())
    body: dict[str, object] = {"status": "ready" if ok else "not_ready", "models": models}
    # Why instances are out of service (a crash, missed probes, no progress), while they are.
    problems = {
        name: [f"instance {i.id} {i.failure}" for i in model_pool.instances if i.failure]
        for name, model_pool in pool.pools.items()
    }
    if any(problems.values()):
        body["problems"] = {name: found for name, found in problems.items() if found}
    return JSONResponse(body, status_code=200 if ok else 503)
