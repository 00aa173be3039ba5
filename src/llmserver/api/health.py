"""Liveness and readiness, open to anyone (health.py says what each checks)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from llmserver.api.access import Access, router
from llmserver.api.deps import supervisor
from llmserver.health import Readiness

public = router(Access.PUBLIC)
routers = (public,)


@public.get("/health")
async def health() -> dict[str, str]:
    """The process answers; no dependency is checked (that is /ready)."""
    return {"status": "ok"}


@public.get("/ready", response_model=None)
async def ready(request: Request) -> JSONResponse:
    readiness: Readiness = request.app.state.readiness
    await readiness.check()
    body = readiness.body()
    pool = supervisor(request)
    body["models"] = {name: model_pool.ready for name, model_pool in pool.pools.items()}
    # Why a model cannot run (its files, a failed start, no node to place it on) and why instances are
    # out of service (a crash, missed probes, no progress), while they are.
    problems = {
        name: [reason for reason in [model_pool.unstartable or model_pool.blocked] if reason]
        + [f"instance {i.id} {i.failure}" for i in model_pool.instances if i.failure]
        for name, model_pool in pool.pools.items()
    }
    if any(problems.values()):
        body["problems"] = {name: found for name, found in problems.items() if found}
    return JSONResponse(body, status_code=200 if readiness.ready else 503)
