"""POST /v1/embeddings (OpenAI-compatible), served by models configured with embedding = true."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from llmserver.api.deps import body_schema, cancel_on_disconnect, embeddings, parse
from llmserver.engine.generation import closed_on_failure
from llmserver.schemas.openai import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
async def create_embeddings(request: Request) -> dict[str, Any]:
    service = embeddings(request)
    principal, body = await parse(request, EmbeddingRequest, gate=service.admission.precheck)
    ticket = await service.admit(principal, body)
    request.state.tally = ticket.tally  # for the access log
    with closed_on_failure(ticket):
        return await cancel_on_disconnect(request, service.embed(ticket, body))
