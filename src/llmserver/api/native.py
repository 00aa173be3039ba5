"""POST /api/generate: the native API."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from llmserver.api.access import Access, router
from llmserver.api.deps import (
    FastJSONResponse,
    body_schema,
    cancel_on_disconnect,
    direct,
    generation,
    header,
    jobs,
    note,
    parse,
)
from llmserver.engine.generation import closed_on_failure
from llmserver.jobs.runner import JobService
from llmserver.schemas.native import GenerateRequest, GenerateResponse

# Each endpoint authenticates first thing (deps.parse): the key may travel in the body, and a large
# body is gated by a key in the header before it is read.
generating = router(Access.OWN)
routers = (generating,)


@generating.post(
    "/api/generate",
    responses={200: {"model": GenerateResponse}},
    openapi_extra=body_schema(GenerateRequest),
)
@direct
async def generate(request: Request) -> FastJSONResponse:
    service = generation(request)
    principal, body = await parse(request, GenerateRequest, gate=service.admission.precheck)
    key = JobService.client_key(body.key) if body.mode == "async" else None
    ticket = await service.admit(principal, body, "/api/generate", header(request, b"x-session-id"))
    note(request, "tally", ticket.tally)  # for the access log

    async def work() -> dict[str, Any]:
        return (await service.generate(ticket, body)).model_dump()

    if key is not None:
        await service.check_inputs(ticket, body)
        with closed_on_failure(ticket):
            return FastJSONResponse(await jobs(request).submit(principal, work, key=key, webhook_url=body.webhook_url))
    # A sync request that outlasts sync_timeout turns into an async job and answers with its payload.
    with closed_on_failure(ticket):
        return FastJSONResponse(await cancel_on_disconnect(request, jobs(request).sync_or_fallback(principal, work)))
