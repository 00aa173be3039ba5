"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (a chat request
underneath: `schemas/anthropic.py`). Its errors are Anthropic's error object (app.py renders them so
for these paths); its key may come as `x-api-key`, as Anthropic's SDK sends it."""

from __future__ import annotations

from fastapi import Request

from llmserver.api import translated
from llmserver.api.access import Access, router
from llmserver.api.deps import FastJSONResponse, body_schema, direct
from llmserver.api.events import EventStream
from llmserver.dialects import anthropic
from llmserver.schemas.anthropic import PARAMS, MessagesRequest

# Each endpoint authenticates first thing (deps.parse): the key may travel in the body, and a large
# body is gated by a key in the header before it is read.
generating = router(Access.OWN)
routers = (generating,)


class CountRequest(MessagesRequest):
    max_tokens: int = 1  # not needed to count


@generating.post("/v1/messages", openapi_extra=body_schema(MessagesRequest), response_model=None)
@direct
async def create_message(request: Request) -> FastJSONResponse | EventStream:
    principal, _, chat = await translated.read(request, MessagesRequest, PARAMS)
    return await translated.answer(request, principal, chat, "/v1/messages", anthropic.message, anthropic.Voice)


@generating.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountRequest), response_model=None)
@direct
async def count_tokens(request: Request) -> FastJSONResponse:
    """The prompt's tokens as the model's template and tokenizer make them. It is a request (admitted,
    counted in the key's rpm, recorded in the ledger) that generates and charges nothing."""
    principal, _, chat = await translated.read(request, CountRequest, PARAMS)
    return FastJSONResponse(
        {"input_tokens": await translated.count(request, principal, chat, "/v1/messages/count_tokens")}
    )
