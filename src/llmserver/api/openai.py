"""OpenAI-compatible generation: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmserver.api.deps import cancel_on_disconnect, generation, parse
from llmserver.schemas.openai import ChatRequest, CompletionRequest

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _body_schema(model: Any) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


@router.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest), response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    principal, body = await parse(request, ChatRequest)
    service = generation(request)
    if body.stream:
        stream = await service.chat_stream(principal, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request, service.chat(principal, body)))


@router.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest), response_model=None)
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    principal, body = await parse(request, CompletionRequest)
    service = generation(request)
    if body.stream:
        stream = await service.completion_stream(principal, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request, service.completion(principal, body)))
