"""GET /v1/models: the seed's model list, with each model's 30-day average speed once it has one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from llmserver.api.deps import authenticate, settings, speed
from llmserver.auth.keys import may_use

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    principal = await authenticate(request)
    config = settings(request)
    created = int(request.app.state.started_at)
    data = []
    for model in config.models:
        if not may_use(principal.limits, model.name):
            continue
        entry: dict[str, Any] = {"id": model.name, "object": "model", "created": created, "owned_by": config.owned_by}
        average = speed(request).average(model.name)  # in memory: no ledger scan; omitted while there is no data
        if average is not None:
            entry["avg_tokens_per_second"] = average
        entry["vision_capable"] = model.vision_capable
        entry["embedding"] = model.embedding
        data.append(entry)
    return {"object": "list", "data": data}
