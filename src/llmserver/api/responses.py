"""OpenAI's Responses API: POST /v1/responses (a chat request underneath: `schemas/responses.py`)."""

from __future__ import annotations

from fastapi import Request

from llmserver.api import translated
from llmserver.api.access import Access, router
from llmserver.api.deps import FastJSONResponse, body_schema, direct
from llmserver.api.events import EventStream
from llmserver.dialects import responses
from llmserver.schemas.responses import PARAMS, ResponsesRequest

# Each endpoint authenticates first thing (deps.parse): the key may travel in the body, and a large
# body is gated by a key in the header before it is read.
generating = router(Access.OWN)
routers = (generating,)


@generating.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest), response_model=None)
@direct
async def create_response(request: Request) -> FastJSONResponse | EventStream:
    principal, body, chat = await translated.read(request, ResponsesRequest, PARAMS)
    return await translated.answer(
        request, principal, chat, "/v1/responses",
        shape=lambda answer: responses.response(answer, body),
        voice=lambda model, _: responses.Voice(body, model),
    )  # fmt: skip


class InputTokensRequest(ResponsesRequest):
    stream: bool = False


@generating.post("/v1/responses/input_tokens", openapi_extra=body_schema(InputTokensRequest), response_model=None)
@direct
async def input_tokens(request: Request) -> FastJSONResponse:
    """The prompt tokens a response to this request would read, as the model's template and tokenizer make
    them. It is a request (admitted, counted in the key's rpm, a ledger row) that generates and charges nothing."""
    principal, _, chat = await translated.read(request, InputTokensRequest, PARAMS)
    tokens = await translated.count(request, principal, chat, "/v1/responses/input_tokens")
    return FastJSONResponse({"object": "response.input_tokens", "input_tokens": tokens})
