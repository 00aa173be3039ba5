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
    return JSONResponse({"status": "ready" if ok else "not_ready", "models": models}, status_code=200 if ok else 503)
