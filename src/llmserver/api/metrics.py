"""GET /metrics: Prometheus text, for admin keys (or anyone with metrics_public)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserver.api.deps import metrics as metrics_of
from llmserver.api.deps import require_admin, settings

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    if not settings(request).metrics_public:
        await require_admin(request)
    return Response(metrics_of(request).render(), media_type=CONTENT_TYPE_LATEST)
