"""What the APIs that are chat underneath share (OpenAI's Responses, Anthropic's Messages): a request
read as a chat request, admitted and answered by the chat path, and its refusals named in the
client's own API's terms."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import Request

from llmserver.api.deps import FastJSONResponse, cancel_on_disconnect, generation, header, validate
from llmserver.api.events import EventStream
from llmserver.auth.keys import Principal
from llmserver.engine.generation import closed_on_failure
from llmserver.errors import APIError
from llmserver.schemas.openai import ChatRequest

JSON = dict[str, Any]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@contextmanager
def renamed(origins: Sequence[str], names: Mapping[str, str]) -> Iterator[None]:
    """Errors that name a chat parameter name the client's instead: `messages.N…` the item message N
    came from (`origins`), the others through `names`."""
    try:
        yield
    except APIError as exc:
        if exc.param:
            old, new = exc.param, _rename(exc.param, origins, names)
            exc.param = new
            if exc.message.startswith(old):
                exc.message = new + exc.message[len(old) :]
        raise


def _rename(param: str, origins: Sequence[str], names: Mapping[str, str]) -> str:
    head, _, rest = param.partition(".")
    if head == "messages":
        index, _, tail = rest.partition(".")
        if index.isdigit() and int(index) < len(origins):
            return origins[int(index)] + (f".{tail}" if tail else "")
        return names.get("messages", head)
    return names.get(head, head) + (f".{rest}" if rest else "")


async def answer(
    request: Request,
    principal: Principal,
    chat_body: JSON,
    origins: Sequence[str],
    names: Mapping[str, str],
    endpoint: str,
    shape: Callable[[JSON], JSON],
    events: Callable[[AsyncGenerator[bytes, Any], str], AsyncGenerator[bytes, Any]],
    adjust: Callable[[ChatRequest], None] | None = None,
) -> FastJSONResponse | EventStream:
    """The chat request `chat_body` admitted and answered as any chat request; its answer shaped by
    `shape`, or its stream's chunks turned into `events`."""
    service = generation(request)
    with renamed(origins, names):
        chat = validate(ChatRequest, chat_body)
        if adjust is not None:
            adjust(chat)
        ticket = await service.admit(principal, chat, endpoint, header(request, b"x-session-id"))
        request.state.tally = ticket.tally  # for the access log
        served = {"x-llmserver-instance": ticket.tally.instance_id or ""}
        with closed_on_failure(ticket):
            if chat.stream:
                stream = await service.chat_stream(ticket, chat)
                return EventStream(events(stream, ticket.model), {**SSE_HEADERS, **served})
            answered = await cancel_on_disconnect(request, service.chat(ticket, chat))
        return FastJSONResponse(shape(answered), headers=served)
