"""POST /api/generate: the native API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from llmserver.api.deps import body_schema, cancel_on_disconnect, generation, jobs, parse
from llmserver.schemas.native import GenerateRequest, GenerateResponse

router = APIRouter()


@router.post(
    "/api/generate",
    responses={200: {"model": GenerateResponse}},
    openapi_extra=body_schema(GenerateRequest),
)
async def generate(request: Request) -> dict[str, Any]:
    principal, body = await parse(request, GenerateRequest)
    service = generation(request)

    async def work() -> dict[str, Any]:
        return (await service.generate(principal, body)).model_dump()

    if body.mode == "async":
        await service.check_inputs(body)
        return await jobs(request).submit(principal, work, key=body.key, webhook_url=body.webhook_url)
    # A sync request that outlasts sync_timeout turns into an async job and answers with its payload.
    return await cancel_on_disconnect(request, jobs(request).sync_or_fallback(principal, work))
