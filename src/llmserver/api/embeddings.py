"""POST /v1/embeddings (OpenAI-compatible), served by models configured with embedding = true."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from llmserver.api.access import Access, router
from llmserver.api.deps import body_schema, cancel_on_disconnect, embeddings, note, parse
from llmserver.engine.generation import closed_on_failure
from llmserver.schemas.openai import EmbeddingRequest

# Each endpoint authenticates first thing (deps.parse): the key may travel in the body, and a large
# body is gated by a key in the header before it is read.
generating = router(Access.OWN)
routers = (generating,)


@generating.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
async def create_embeddings(request: Request) -> dict[str, Any]:
    service = embeddings(request)
    principal, body = await parse(request, EmbeddingRequest, gate=service.admission.precheck)
    ticket = await service.admit(principal, body)
    note(request, "tally", ticket.tally)  # for the access log
    with closed_on_failure(ticket):
        return await cancel_on_disconnect(request, service.embed(ticket, body))
