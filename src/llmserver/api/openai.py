"""OpenAI-compatible generation: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmserver.api.deps import body_schema, cancel_on_disconnect, generation, jobs, parse
from llmserver.auth.keys import Principal
from llmserver.errors import InvalidRequest
from llmserver.jobs.runner import Work
from llmserver.schemas.openai import ChatRequest, CompletionRequest

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _submit(
    request: Request, principal: Principal, body: ChatRequest | CompletionRequest, work: Work
) -> dict[str, Any]:
    """The async extension: the same job as /api/generate's, whose result is this endpoint's object."""
    if body.stream:
        raise InvalidRequest("Async mode cannot be combined with stream: true.", param="stream")
    if isinstance(body, ChatRequest):
        await generation(request).check_inputs(body)
    return await jobs(request).submit(principal, work, key=body.key, webhook_url=body.webhook_url)


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest), response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    principal, body = await parse(request, ChatRequest)
    service = generation(request)
    if body.mode == "async":
        return JSONResponse(await _submit(request, principal, body, lambda: service.chat(principal, body)))
    if body.stream:
        stream = await service.chat_stream(principal, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request, service.chat(principal, body)))


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest), response_model=None)
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    principal, body = await parse(request, CompletionRequest)
    service = generation(request)
    if body.mode == "async":
        return JSONResponse(await _submit(request, principal, body, lambda: service.completion(principal, body)))
    if body.stream:
        stream = await service.completion_stream(principal, body)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request, service.completion(principal, body)))
