"""OpenAI-compatible generation: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from collections.abc import Awaitable
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
from llmserver.api.events import EventStream
from llmserver.engine.generation import closed_on_failure
from llmserver.errors import InvalidRequest
from llmserver.jobs.runner import JobService
from llmserver.pool.admission import Ticket
from llmserver.schemas.openai import ChatRequest, CompletionRequest

# Each endpoint authenticates first thing (deps.parse): the key may travel in the body, and a large
# body is gated by a key in the header before it is read.
generating = router(Access.OWN)
routers = (generating,)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@generating.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest), response_model=None)
@direct
async def chat_completions(request: Request) -> FastJSONResponse | EventStream:
    return await _generate(request, ChatRequest, "/v1/chat/completions")


@generating.post("/v1/completions", openapi_extra=body_schema(CompletionRequest), response_model=None)
@direct
async def completions(request: Request) -> FastJSONResponse | EventStream:
    return await _generate(request, CompletionRequest, "/v1/completions")


async def _generate(
    request: Request, kind: type[ChatRequest] | type[CompletionRequest], endpoint: str
) -> FastJSONResponse | EventStream:
    service = generation(request)
    principal, body = await parse(request, kind, gate=service.admission.precheck)
    key = None
    if body.mode == "async":  # our extension: the same job as /api/generate's, with this endpoint's object
        if body.stream:
            raise InvalidRequest("Async mode cannot be combined with stream: true.", param="stream")
        key = JobService.client_key(body.key)
    ticket = await service.admit(principal, body, endpoint, header(request, b"x-session-id"))
    note(request, "tally", ticket.tally)  # for the access log

    def work() -> Awaitable[dict[str, Any]]:  # the answer's coroutine (a job's, or awaited here)
        return service.chat(ticket, body) if isinstance(body, ChatRequest) else service.completion(ticket, body)

    if key is not None:
        if isinstance(body, ChatRequest):
            await service.check_inputs(ticket, body)
        with closed_on_failure(ticket):
            return FastJSONResponse(await jobs(request).submit(principal, work, key=key, webhook_url=body.webhook_url))
    with closed_on_failure(ticket):
        if body.stream:
            if isinstance(body, ChatRequest):
                stream = await service.chat_stream(ticket, body)
            else:
                stream = await service.completion_stream(ticket, body)
            # The serving instance is known once the stream is open: the console shows it.
            return EventStream(stream, {**SSE_HEADERS, **served(ticket)})
        answer = await cancel_on_disconnect(request, work())
        return FastJSONResponse(answer, headers=served(ticket))


def served(ticket: Ticket) -> dict[str, str]:
    """The header that names the instance an OpenAI answer came from (the native API has a field)."""
    return {"x-llmserver-instance": ticket.tally.instance_id or ""}
