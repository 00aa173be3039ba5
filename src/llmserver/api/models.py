"""GET /v1/models: the seed's model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from llmserver.api.deps import authenticate, settings

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    authenticate(request)
    config = settings(request)
    created = int(request.app.state.started_at)
    return {
        "object": "list",
        "data": [
            # avg_tokens_per_second is omitted until a model has speed data (the quota/usage issue).
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": config.owned_by,
                "vision_capable": False,
            }
            for m in config.models
        ],
    }
