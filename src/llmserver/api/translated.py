"""What the APIs that are chat underneath share (OpenAI's Responses, Anthropic's Messages): a request
read as a chat request, admitted and answered by the chat path, and its refusals named in the
client's own API's terms."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import Request

from llmserver.api.deps import FastJSONResponse, cancel_on_disconnect, generation, header, note, parse
from llmserver.api.events import EventStream
from llmserver.auth.keys import Principal
from llmserver.engine.generation import GenerationService, closed_on_failure
from llmserver.engine.shapes import Voice
from llmserver.errors import APIError
from llmserver.metrics.recorder import Tally
from llmserver.pool.admission import Ticket
from llmserver.schemas.common import AsChat, AsChatRequest
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
    if head == "messages" and not origins:
        return param  # raised while translating: it already names the client's own place
    if head == "messages":
        index, _, tail = rest.partition(".")
        if index.isdigit() and int(index) < len(origins):
            return origins[int(index)] + (f".{tail}" if tail else "")
        return names.get("messages", head)
    return names.get(head, head) + (f".{rest}" if rest else "")


Translatable = TypeVar("Translatable", bound=AsChatRequest)


async def read(
    request: Request, kind: type[Translatable], names: Mapping[str, str]
) -> tuple[Principal, Translatable, AsChat]:
    """The caller, the request as `kind`, and the chat request it is (its refusals named by `names`)."""
    principal, body = await parse(request, kind, gate=generation(request).admission.precheck)
    with renamed([], names):
        return principal, body, body.chat()


async def _admitted(
    request: Request, principal: Principal, chat: AsChat, endpoint: str, **fields: Any
) -> tuple[GenerationService, ChatRequest, Ticket]:
    """The chat request (its body and `fields`) validated and admitted (errors renamed by the caller)."""
    service = generation(request)
    body = ChatRequest.of(chat, **fields)
    ticket = await service.admit(principal, body, endpoint, header(request, b"x-session-id"))
    note(request, "tally", ticket.tally)  # for the access log
    return service, body, ticket


async def count(request: Request, principal: Principal, chat: AsChat, endpoint: str) -> int:
    """The prompt tokens of `chat`: admitted as a request (its rpm, a ledger row) that generates and
    charges nothing."""
    with renamed(chat.origins, chat.names):
        service, body, ticket = await _admitted(request, principal, chat, endpoint, max_tokens=1, stream=False)
        body.stream_options = None
        return await service.count_tokens(ticket, body)


async def answer(
    request: Request,
    principal: Principal,
    chat: AsChat,
    endpoint: str,
    shape: Callable[[JSON], JSON],
    voice: Callable[[str, Tally], Voice],
) -> FastJSONResponse | EventStream:
    """`chat` admitted and answered as any chat request; its answer shaped by `shape`, or its stream
    spoken by `voice` (given the model and the request's tally: its prompt's counts are known by the
    time the stream opens)."""
    with renamed(chat.origins, chat.names):
        service, body, ticket = await _admitted(request, principal, chat, endpoint)
        with closed_on_failure(ticket):
            if body.stream:
                stream = await service.chat_stream(ticket, body, voice(ticket.model, ticket.tally))
                return EventStream(stream, {**SSE_HEADERS, **_served(ticket)})
            answered = await cancel_on_disconnect(request, service.chat(ticket, body))
        return FastJSONResponse(shape(answered), headers=_served(ticket))


def _served(ticket: Ticket) -> dict[str, str]:
    """The instance that answers, once its slot is taken (issue 55: it was read before, and empty)."""
    return {"x-llmserver-instance": ticket.tally.instance_id or ""}
