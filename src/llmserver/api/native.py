"""POST /api/generate: the native API."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmserver.api.deps import cancel_on_disconnect, generation, parse
from llmserver.schemas.native import GenerateRequest, GenerateResponse

router = APIRouter()


@router.post(
    "/api/generate",
    response_model=GenerateResponse,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": GenerateRequest.model_json_schema()}},
        }
    },
)
async def generate(request: Request) -> GenerateResponse:
    principal, body = await parse(request, GenerateRequest)
    return await cancel_on_disconnect(request, generation(request).generate(principal, body))
