"""The generation service: one method per endpoint, each the same steps in the same order.

1. `admit()`, which the routers call first for every endpoint (async submissions included): the
   model and max_tokens are checked, then admission (`pool/admission.py`) runs with a quota bound
   read from the request as sent: nothing is decoded, fetched or templated before it says yes.
2. The slot (the model's queue lease), then the inputs (`inputs/prepare.py`: images and files →
   prepared messages, one path for chat and the native API), then the reservation resized to the
   bound of the prepared prompt.
3. The instance call (`engine/calls.py`: the one retry policy).
4. The response shape (`engine/shapes.py`); streams relay events as they come.

Every path closes its ticket exactly once. Streams are opened (and their first event awaited)
before the HTTP response starts, so an error that llama-server reports up front (an over-long
prompt, say) is still an ordinary HTTP error; once streaming, a failure becomes one error event
followed by `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from llmserver.asgi_ext import Writer  # bytes straight to a stream's client; False: no more for now
from llmserver.auth.keys import Principal
from llmserver.auth.revocation import KeyWatch
from llmserver.engine import reasoning, resume, shapes, translate
from llmserver.engine.calls import InstanceCalls, stalled_error
from llmserver.engine.schemas import check_schema
from llmserver.engine.tools import ToolPlan, added_prompt, check_request, json_schema_format
from llmserver.errors import APIError, ContextLengthExceeded, InvalidRequest, ServerError
from llmserver.inputs.documents import native_file_parts
from llmserver.inputs.prepare import CHAT, InputService, NativeWhere, Where, text_bound
from llmserver.llama import wire
from llmserver.llama.client import Sink, parse_event
from llmserver.llama.template import Template
from llmserver.metrics.recorder import Tally, UsageRecorder
from llmserver.pool.admission import Admission, Ticket, outcome_of
from llmserver.pool.affinity import affinity_key
from llmserver.pool.instance import slot_context
from llmserver.schemas.native import GenerateRequest, GenerateResponse
from llmserver.schemas.openai import ChatMessage, ChatRequest, CompletionRequest, TranslatedChat
from llmserver.settings import ModelConfig, Settings

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Request = GenerateRequest | ChatRequest | CompletionRequest
# Room around an untemplated prompt (a BOS token and the like).
RAW_PROMPT_TOKENS = 8
# More bytes than any token of any tokenizer spells: a prompt's byte count over this is a lower
# bound of its tokens.
MAX_TOKEN_BYTES = 256
# What of a chat payload llama-server's /apply-template renders.
TEMPLATE_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
COUNT_TIMEOUT = 10.0  # seconds for an instance to render and count a prompt before the queue
KEEPALIVE_SECONDS = 10.0  # a stream quiet this long while its prompt is read gets a keepalive


def closed_on_failure(ticket: Ticket) -> AbstractContextManager[None]:
    """Close the ticket if the block fails: settled to nothing, the outcome recorded."""
    return _ClosedOnFailure(ticket)


class _ClosedOnFailure(AbstractContextManager[None]):
    # A class, not a @contextmanager generator: it wraps several steps of every request, and a
    # generator's context manager costs a few times as much to enter and leave.
    __slots__ = ("ticket",)

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None:
            self.ticket.close(outcome_of(exc))


class GenerationService:
    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        inputs: InputService,
        calls: InstanceCalls,
        recorder: UsageRecorder,
        models: list[ModelConfig] | None = None,
        key_watch: KeyWatch | None = None,
    ) -> None:
        self.admission = admission
        self.key_watch = key_watch  # ends a stream whose key stops standing while it runs
        self.inputs = inputs
        self.calls = calls
        self.recorder = recorder
        self.use_models(settings.models if models is None else models)  # the configured ones unless told
        self.default_max_tokens = settings.limits.default_max_tokens
        self.max_tokens_limit = settings.limits.max_tokens
        self.max_messages = settings.limits.max_messages
        self.max_pattern_cost = settings.limits.max_pattern_cost
        self.max_keep_alive = settings.limits.max_keep_alive

    def use_models(self, models: list[ModelConfig]) -> None:
        """The models served now (at start, and after each change to the model catalog)."""
        chat_models = [model.name for model in models if not model.embedding]
        self.default_model = chat_models[0] if chat_models else (models[0].name if models else "")
        self.embedding_models = {model.name for model in models if model.embedding}
        # A request's prompt and completion together never exceed its slot's context.
        self._context = {model.name: slot_context(model) for model in models}

    # Step 1: admission, for every endpoint

    async def admit(self, principal: Principal, request: Request, endpoint: str, session: str | None = None) -> Ticket:
        """Admission for a request; `session` is its X-Session-Id header (for prompt-cache affinity)."""
        model = request.model or self.default_model
        if model in self.embedding_models:
            raise InvalidRequest(
                f"The model {model!r} serves embeddings only (POST /v1/embeddings), not generation.", param="model"
            )
        max_tokens = self._max_tokens(request)
        if isinstance(request, ChatRequest):
            if len(request.messages) > self.max_messages:
                raise InvalidRequest(
                    f"messages: {len(request.messages)} messages; this server takes at most {self.max_messages} "
                    "in one request",
                    param="messages",
                )
            check_request(request, self.max_pattern_cost)
            counted = self.inputs.bound(request.messages)
            prompt = counted + text_bound(added_prompt(request))
        elif isinstance(request, CompletionRequest):
            prompt = RAW_PROMPT_TOKENS + text_bound(_completion_prompt(request))
        else:
            if request.images and request.raw:
                raise InvalidRequest(
                    "Images need the chat template: they cannot be sent with raw: true.", param="images"
                )
            check_schema(native_schema(request), "format", most=self.max_pattern_cost)
            prompt = self.inputs.bound(_native_messages(request))
        self._surely_too_long(model, prompt, "messages" if isinstance(request, ChatRequest) else "prompt")
        bound = self._bound(model, prompt, max_tokens)
        keep_alive = check_keep_alive(request.keep_alive, self.max_keep_alive)
        affinity = _affinity(model, request, session) if self.admission.routes_by_affinity(model) else None
        ticket = await self.admission.admit(
            principal, endpoint, model, bound, affinity, keep_alive, completion=min(max_tokens, bound)
        )
        if isinstance(request, ChatRequest):
            ticket.counted = (request.messages, counted)
        return ticket

    def _max_tokens(self, request: Request) -> int:
        requested = request.max_tokens
        if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
            requested = request.max_completion_tokens
        if requested is None:
            return self.default_max_tokens
        # An upper bound, so the most this server allows rather than a refusal: an answer cut there ends
        # with the finish reason that says so (`length`, `max_tokens`). Agents ask for 32,000 by default.
        return min(requested, self.max_tokens_limit)

    def _surely_too_long(self, model: str, prompt_bound: int, param: str) -> None:
        """Refuse, without sending it, a prompt that cannot fit even if every token were as long as
        the longest a tokenizer has (its bound counts bytes; no token is longer than 256 of them)."""
        context = self._context.get(model)
        if context is not None and prompt_bound // MAX_TOKEN_BYTES > context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens; the prompt is at least "
                f"{prompt_bound // MAX_TOKEN_BYTES} tokens.",
                param=param,
            )

    def _messages_bound(self, ticket: Ticket, messages: list[ChatMessage]) -> int:
        """`inputs.bound(messages)`, as admission counted it when these are the messages it counted."""
        counted = ticket.counted
        if counted is not None and counted[0] is messages:
            return counted[1]
        return self.inputs.bound(messages)

    def _bound(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        return min(prompt_tokens + max_tokens, self._context.get(model, prompt_tokens + max_tokens))

    async def check_inputs(self, ticket: Ticket, request: ChatRequest | GenerateRequest) -> None:
        """For an async submission: the input checks that need no fetching or extraction, and every
        file decoded and sniffed, so that such a request is refused before the job is accepted."""
        with closed_on_failure(ticket):
            if isinstance(request, ChatRequest):
                messages, where = request.messages, CHAT
            else:
                messages, where = _native_messages(request), NativeWhere(len(request.files or []))
            self.inputs.check(messages, ticket.model, where)
            await self.inputs.decode_files(messages, where)

    # Step 2: the slot, the inputs, the resized reservation

    async def _prepared(self, ticket: Ticket, messages: list[ChatMessage], where: Where = CHAT) -> list[ChatMessage]:
        await self.admission.take_slot(ticket)
        return await self.inputs.prepare(messages, ticket.model, where, ticket.tally.principal.key_id)

    async def _resize(self, ticket: Ticket, prompt_tokens: int, payload: JSON) -> None:
        await self.admission.resize(ticket, self._bound(ticket.model, prompt_tokens, int(payload["max_tokens"])))

    # Steps 3 and 4, for each endpoint

    async def generate(self, ticket: Ticket, request: GenerateRequest) -> GenerateResponse:
        with closed_on_failure(ticket):
            where = NativeWhere(len(request.files or []))
            messages = await self._prepared(ticket, _native_messages(request), where)
            payload = translate.sampling_payload(request, self._max_tokens(request), request.stop)
            schema = native_schema(request)
            if request.raw:
                system = f"{request.system}\n\n" if request.system else ""
                payload["prompt"] = system + translate.message_text(messages[-1])
                if schema is not None:
                    payload["json_schema"] = schema
                await self._resize(ticket, RAW_PROMPT_TOKENS + text_bound(payload["prompt"]), payload)
                path = "/v1/completions"
            else:
                payload["messages"] = translate.chat_messages(messages)
                if schema is not None:
                    payload["response_format"] = json_schema_format(schema)
                await self._resize(ticket, self.inputs.bound(messages), payload)
                path = "/v1/chat/completions"
            with schema_errors("format" if schema is not None else None):
                body = await self.calls.call(ticket, path, payload)
        await self._called(ticket, body)
        text = shapes.completion_text(body) if request.raw else shapes.chat_text(body)
        latency = time.perf_counter() - ticket.tally.started
        counts = translate.usage(body)
        return GenerateResponse(
            response=shapes.unfenced(text) if schema is not None else text,
            model=ticket.model,
            instance_id=ticket.tally.instance_id or "",
            prompt_tokens=counts["prompt_tokens"],
            completion_tokens=counts["completion_tokens"],
            # As the seed defines it: completion tokens over the whole request's latency.
            tokens_per_second=round(counts["completion_tokens"] / latency, 2) if latency > 0 else 0.0,
            latency_ms=round(latency * 1000, 1),
        )

    async def _counted_before_the_queue(self, ticket: Ticket, request: ChatRequest) -> None:
        """A text prompt that may not fit the model's context is counted before it waits for a slot, by
        an instance's template and tokenizer (llama-server's /apply-template and /tokenize, answered by
        its HTTP threads whatever its slots are doing): one too long is refused at once, not after the
        queue (140 s on a busy instance, issue 55). A prompt whose bound (bytes) is within the context
        surely fits and costs nothing here; images and files are counted once read, on the slot."""
        context = self._context.get(ticket.model)
        if context is None or self._messages_bound(ticket, request.messages) < context:
            return
        if any(isinstance(m.content, list) and any(p.type != "text" for p in m.content) for m in request.messages):
            return
        instance = next((i for i in ticket.lease.pool.instances if i.accepting and i.client is not None), None)
        if instance is None or instance.client is None:
            return  # none ready yet: counted on its slot
        plan = ToolPlan.of(request, native=instance.template.tools)
        payload = translate.chat_payload(request, self._max_tokens(request), plan.payload(list(request.messages)))
        template = {key: payload[key] for key in TEMPLATE_FIELDS if key in payload}
        try:
            prompt = (await instance.client.post_json("/apply-template", template, timeout=COUNT_TIMEOUT))["prompt"]
            counted = {"content": prompt, "add_special": True, "parse_special": True}
            tokens = len((await instance.client.post_json("/tokenize", counted, timeout=COUNT_TIMEOUT))["tokens"])
        except (APIError, KeyError, TypeError):
            return  # the slot's own call says what is wrong
        if tokens >= context:
            raise ContextLengthExceeded(
                # OpenAI's words, which clients read as a full context (litellm: aider, LiteLLM's proxy).
                f"This model's maximum context length is {context} tokens; the prompt is {tokens} tokens, "
                f"{tokens - context} more.",
                param="messages",
                tokens=tokens,
                context=context,
            )

    async def _chat_payload(
        self, ticket: Ticket, request: ChatRequest, counting: bool = False
    ) -> tuple[JSON, ToolPlan]:
        if not counting:  # a count of a prompt too long is what its client wants to know: how much to cut
            await self._counted_before_the_queue(ticket, request)
        messages = await self._prepared(ticket, request.messages)
        # The slot is taken: its instance's chat template decides how tools and reasoning are served.
        instance = ticket.lease.instance
        template = instance.template if instance is not None else Template()
        plan = ToolPlan.of(request, native=template.tools)
        max_tokens = self._max_tokens(request)
        payload = translate.chat_payload(request, max_tokens, plan.payload(messages))
        translated = request if isinstance(request, TranslatedChat) else None
        budget = translated._thinking_budget if translated is not None else None
        optional = translated is not None and translated._thinking_optional
        payload.update(reasoning.fields(request.reasoning_effort, budget, max_tokens, template, ticket.model, optional))
        if translated is not None and translated._names_stop:
            # llama.cpp names the stop sequence that ended an answer only in its `__verbose` (which also
            # holds the prompt): asked for only when the client wants the sequence named.
            payload["verbose"] = True
        await self._resize(ticket, self._messages_bound(ticket, messages), payload)
        return payload, plan

    async def chat(self, ticket: Ticket, request: ChatRequest) -> JSON:
        with closed_on_failure(ticket):
            payload, plan = await self._chat_payload(ticket, request)
            with schema_errors(plan.schema_param):
                body = await self.calls.call(ticket, "/v1/chat/completions", payload)
        usage = await self._called(ticket, body)
        return shapes.chat(body, ticket.model, plan, usage, request.top_logprobs or 0)

    async def chat_stream(
        self, ticket: Ticket, request: ChatRequest, voice: shapes.Voice | None = None
    ) -> AsyncGenerator[bytes, Writer | None]:
        """The chat stream in OpenAI's chunks, or in another API's events (`voice`: dialects/)."""

        async def prepared() -> tuple[JSON, shapes.StreamShape]:
            payload, plan = await self._chat_payload(ticket, request)
            return payload, shapes.ChatStream(plan, request.top_logprobs or 0)

        if voice is None:
            head = translate.head("chatcmpl", "chat.completion.chunk", ticket.model)
            voice = shapes.OpenAIVoice(head, _include_usage(request))
        return await self._stream(ticket, "/v1/chat/completions", prepared, voice)

    async def count_tokens(self, ticket: Ticket, request: ChatRequest) -> int:
        """The prompt tokens of a chat request, as its instance's template and tokenizer make them (its
        images count as their place in the template only); nothing is generated or charged."""
        with closed_on_failure(ticket):
            payload, _ = await self._chat_payload(ticket, request, counting=True)
            client = ticket.lease.client
            if client is None:
                raise ServerError("The instance went away.")
            template = {key: payload[key] for key in TEMPLATE_FIELDS if key in payload}
            prompt = (await client.post_json("/apply-template", template, timeout=self.calls.timeout))["prompt"]
            counted = {"content": prompt, "add_special": True, "parse_special": True}
            tokens = (await client.post_json("/tokenize", counted, timeout=self.calls.timeout))["tokens"]
        ticket.close("ok")
        await ticket.shared()
        return len(tokens)

    async def _completion_payload(self, ticket: Ticket, request: CompletionRequest) -> JSON:
        await self.admission.take_slot(ticket)
        return translate.completion_payload(request, self._max_tokens(request), _completion_prompt(request))

    def _legacy_logprobs(self, request: CompletionRequest) -> translate.LegacyLogprobs | None:
        if request.logprobs is None:
            return None
        return translate.LegacyLogprobs(request.logprobs, _completion_prompt(request))

    async def completion(self, ticket: Ticket, request: CompletionRequest) -> JSON:
        with closed_on_failure(ticket):
            payload = await self._completion_payload(ticket, request)
            body = await self.calls.call(ticket, "/v1/completions", payload)
        usage = await self._called(ticket, body)
        return shapes.completion(body, ticket.model, self._legacy_logprobs(request), usage)

    async def completion_stream(
        self, ticket: Ticket, request: CompletionRequest
    ) -> AsyncGenerator[bytes, Writer | None]:
        async def prepared() -> tuple[JSON, shapes.StreamShape]:
            payload = await self._completion_payload(ticket, request)
            return payload, shapes.CompletionStream(self._legacy_logprobs(request))

        head = translate.head("cmpl", "text_completion", ticket.model)
        return await self._stream(
            ticket, "/v1/completions", prepared, shapes.OpenAIVoice(head, _include_usage(request))
        )

    async def _called(self, ticket: Ticket, body: JSON) -> JSON:
        """A non-streamed call answered: its counts (returned: the answer's usage) and time to first token,
        and the ticket closed (its freed slot known to the other gateways before the answer goes out)."""
        counts = translate.usage(body)
        ticket.tally.prompt_tokens, ticket.tally.completion_tokens = (
            counts["prompt_tokens"],
            counts["completion_tokens"],
        )
        ticket.tally.cached_tokens = translate.cached_tokens(counts)
        prompt_ms = (body.get("timings") or {}).get("prompt_ms")
        if isinstance(prompt_ms, int | float):
            self.recorder.first_token(ticket.tally, prompt_ms / 1000)
        ticket.close("ok")
        await ticket.shared()
        return counts

    # Streams

    async def _stream(
        self,
        ticket: Ticket,
        path: str,
        prepared: Callable[[], Awaitable[tuple[JSON, shapes.StreamShape]]],
        voice: shapes.Voice,
    ) -> AsyncGenerator[bytes, Writer | None]:
        """The SSE body, already started: its first step (the slot, the inputs, llama-server's first
        event) has run, so that what fails there is a plain HTTP error. From here the body owns the
        ticket: it closes it however it ends, also when it is dropped without being read."""
        body = self._relay(ticket, path, prepared, voice)
        await anext(body)
        return body

    async def _relay(
        self,
        ticket: Ticket,
        path: str,
        prepared: Callable[[], Awaitable[tuple[JSON, shapes.StreamShape]]],
        voice: shapes.Voice,
    ) -> AsyncGenerator[bytes, Writer | None]:
        """The stream's SSE body, in `voice`'s events. Where the server sends in a `Writer`
        (`api/events.py`), the events after the first are pumped: each batch shaped and written in the
        callback that received it. A resumable stream (engine/resume.py) may be asked to give its slot
        back to another key's request: it waits for a slot again and goes on from where it stopped."""
        tally = ticket.tally
        outcome = "client_closed"
        events: AsyncGenerator[list[bytes], Sink | None] | None = None
        try:
            # Progress events carry the prompt's token count up front: a client that leaves early is
            # still charged for its prompt, not only for the tokens it received.
            payload, shape = await prepared()
            payload = {**payload, "return_progress": True}
            pool = ticket.lease.pool
            yields = bool(pool.fair_slice) and resume.resumable(path, payload, pool.config, shape.tokens is not None)
            with schema_errors(shape.schema_param):
                first, events = await self._opened(ticket, path, payload, yields)
        except BaseException as exc:
            ticket.close(outcome_of(exc))
            raise
        _counted(tally, first)
        yield b""  # ready: the HTTP response may start
        sent_any = False
        usage: JSON | None = None
        token, tokens = self.recorder.token, shape.tokens
        text_of, pieces_of = voice.text, voice.pieces
        named_stop: str | None = None  # "" or the stop sequence, once llama.cpp's `__verbose` has come
        quiet_since = time.monotonic()  # when the client last got bytes
        said: list[bytes | str] | None = [] if yields else None  # the answer's text so far, while resumable
        cut = 0  # characters at the start of a resumed chat's stream that repeat what was said
        # Once resumed: the first prompt's tokens, those read from the cache, and the tokens generated
        # before the current call (the usage counts the first prompt once and every generated token).
        before: tuple[int, int, int] | None = None

        def shaped(batch: list[bytes]) -> bytes:
            """Our chunks for a batch of llama-server's events: what arrived together goes out together."""
            nonlocal sent_any, usage, named_stop, quiet_since, said, cut
            if ticket.ended is not None:
                raise ticket.ended
            out: list[bytes] = []
            for data in batch:
                if tokens is not None and not cut and (text := tokens.text(data)) is not None:
                    if text != b'""':
                        token(tally)
                    sent_any = True
                    if said is not None:
                        said.append(text)
                    out.append(text_of(tokens, text))
                    continue
                event = parse_event(data)
                progress = event.get("prompt_progress")
                if isinstance(progress, dict) and before is None:
                    tally.prompt_tokens = int(progress.get("total") or 0)
                choices = event.get("choices") or []
                if "usage" in event:
                    usage = translate.usage(event)
                    if before is not None:
                        usage = _resumed_usage(usage, before)
                    tally.prompt_tokens, tally.completion_tokens = (
                        usage["prompt_tokens"],
                        usage["completion_tokens"],
                    )
                    tally.cached_tokens = translate.cached_tokens(usage)
                if "__verbose" in event:
                    named_stop = shapes.stopping_word(event) or ""
                if progress is not None and sent_any and not cut:  # (a resumed chat's repeated text comes with it)
                    # The prompt is still being read (minutes, on a CPU, for an agent's prompt): after a
                    # quiet while, a comment that keeps the stream alive, which the other APIs turn into
                    # their own keepalive.
                    if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                        out.append(voice.reading())
                elif choices:
                    choice = choices[0]
                    if said is not None:
                        choice, cut = _said(choice, said, cut)
                        if choice is None:  # reasoning or a tool call: its rest could not be asked for
                            said = None
                            ticket.lease.keeps()
                            choice = choices[0]
                    if _generated(choice):
                        token(tally)
                    sent_any = True
                    pieces = shape.pieces(choice)
                    if named_stop is not None:
                        for piece in pieces:
                            if piece.get("finish_reason"):
                                piece["stop_sequence"] = named_stop or None
                    if pieces:
                        out.append(pieces_of(pieces))
            if out:
                quiet_since = time.monotonic()
            return out[0] if len(out) == 1 else b"".join(out)

        writer: Writer | None = None

        def pumped(batch: list[bytes]) -> bool:
            assert writer is not None
            out = shaped(batch)
            return (writer(out) if out else True) and not shape.stopped

        watch = self.key_watch
        watched = watch.track(tally.principal, ticket.end) if watch is not None else 0
        try:
            if opening := voice.opening():
                writer = (yield opening) or writer
            batch: list[bytes] | None = first
            while batch is not None:
                out = shaped(batch)
                if out:
                    writer = (yield out) or writer
                if shape.stopped:
                    # The answer is whole before llama-server's end (a prompted call repeated): leaving
                    # closes the connection, which stops the generation and frees the slot.
                    usage = usage or _tallied(tally)
                    break
                try:
                    batch = await events.asend(pumped if writer is not None else None)
                except StopAsyncIteration:
                    batch = None
                except wire.Preempted:
                    # Its slot went to a key below its share: wait for one again, then ask for the rest.
                    await events.aclose()
                    if before is None:
                        before = (tally.prompt_tokens, tally.cached_tokens, 0)
                    rest = resume.rest(path, payload, resume.said(said or []), tally.completion_tokens)
                    if rest is None:  # max_tokens was reached as it stopped
                        usage = _tallied(tally)
                        writer = (yield pieces_of(shape.pieces(_LENGTH[path]))) or writer
                        break
                    continued, cut = rest
                    await self.admission.requeue(ticket)
                    batch, events = await self._opened(ticket, path, continued, True)
                    before = (before[0], before[1], tally.completion_tokens)
            outcome = "ok"
        except APIError as exc:
            exc = await stalled_error(ticket) or exc  # its instance was restarted under it: say why
            outcome = exc.type
            yield voice.error(exc.body())
        except Exception:
            outcome = "server_error"
            log.exception("a stream failed")
            yield voice.error(ServerError("The stream failed.").body())
        finally:
            if watch is not None:
                watch.untrack(tally.principal, watched)
            await events.aclose()
            ticket.close(outcome)
        await ticket.shared()  # before the client hears the end
        if closing := voice.closing(usage):
            yield closing

    async def _opened(
        self, ticket: Ticket, path: str, payload: JSON, yields: bool
    ) -> tuple[list[bytes], AsyncGenerator[list[bytes], Sink | None]]:
        """The stream's call opened (`calls.open_stream`). One that `yields` is offered to the pool as one
        that can give its slot back: asked to before its first event (it waited in llama-server's queue),
        it waits for a slot again and is sent again."""
        while True:
            stopper = wire.Stopper() if yields else None
            if stopper is not None:
                ticket.lease.yields(stopper.stop, running=False)
            try:
                first, events = await self.calls.open_stream(ticket, path, payload, stopper)
            except wire.Preempted:
                await self.admission.requeue(ticket)
                continue
            if stopper is not None:
                ticket.lease.yields(stopper.stop, running=True)
            return first, events


# A stream's end when max_tokens was reached just as it gave its slot back.
_LENGTH = {
    resume.CHAT: {"index": 0, "delta": {}, "finish_reason": "length"},
    resume.COMPLETION: {"index": 0, "text": "", "finish_reason": "length"},
}


def _said(choice: JSON, said: list[bytes | str], cut: int) -> tuple[JSON | None, int]:
    """A parsed event's choice of a resumable stream: its text kept in `said`, less the first `cut`
    characters of a resumed chat's stream (llama-server repeats the text it continues); None when it
    carries what a continuation could not reproduce (reasoning, a tool call)."""
    delta = choice.get("delta")
    if delta is None:  # a completion's
        text = choice.get("text")
    else:
        if delta.get("reasoning_content") or delta.get("tool_calls"):
            return None, 0
        text = delta.get("content")
        if cut and text:
            dropped = min(cut, len(text))
            cut -= dropped
            text = text[dropped:]
            shorter = {**delta, "content": text} if text else {k: v for k, v in delta.items() if k != "content"}
            choice = {**choice, "delta": shorter}
    if text:
        said.append(text)
    return choice, cut


def _resumed_usage(usage: JSON, before: tuple[int, int, int]) -> JSON:
    """A resumed stream's usage: its first prompt (and what of it came from the cache) once, the tokens
    generated before this call and in it."""
    prompt, cached, generated = before
    completion = generated + int(usage.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }  # fmt: skip


def _include_usage(request: ChatRequest | CompletionRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def _tallied(tally: Tally) -> JSON:
    """The usage of a stream left before llama-server's own count: the prompt's, and one token an event."""
    prompt, completion = tally.prompt_tokens, tally.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": tally.cached_tokens}}  # fmt: skip


def _counted(tally: Tally, first: list[bytes]) -> None:
    """The prompt's tokens, and those read from the cache, from the stream's first progress event: known
    before the answer's first event goes out (Anthropic's `message_start` carries them)."""
    for data in first:
        if b'"prompt_progress"' in data:
            progress = parse_event(data).get("prompt_progress")
            if isinstance(progress, dict):
                tally.prompt_tokens = int(progress.get("total") or 0)
                tally.cached_tokens = int(progress.get("cache") or 0)
            return


def check_keep_alive(keep_alive: float | None, most: float) -> float | None:
    if keep_alive is not None and keep_alive > most:
        raise InvalidRequest(
            f"keep_alive is {keep_alive:g} s; this server allows at most {most:g}.", param="keep_alive"
        )
    return keep_alive


def _generated(event_choice: JSON) -> bool:
    """Whether a stream event carries a generated token."""
    delta = event_choice.get("delta") or {}
    return bool(
        event_choice.get("text") or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
    )


def schema_errors(param: str | None) -> AbstractContextManager[None]:
    """llama-server's refusal of a JSON schema it cannot turn into a grammar, naming the parameter
    the schema came from (`response_format`, `format`, or `tools` for prompted tool calls)."""
    return _SchemaErrors(param)


class _SchemaErrors(AbstractContextManager[None]):  # a class, as _ClosedOnFailure
    __slots__ = ("param",)

    def __init__(self, param: str | None) -> None:
        self.param = param

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        param = self.param
        if param is None or not isinstance(exc, InvalidRequest) or "schema" not in exc.message.lower():
            return
        reason = exc.message.split("failed: ", 1)[-1]
        raise InvalidRequest(
            f"{param}: llama.cpp cannot turn this schema into a grammar: {reason}", param=param
        ) from None


def _affinity(model: str, request: Request, session: str | None) -> str:
    """The request's prompt-cache affinity key: its session, else its OpenAI `user`, else the prefix
    every later turn of its conversation repeats (the system prompt and the first user message)."""
    if session:
        return affinity_key(model, "session", session)
    if isinstance(request, ChatRequest) and request.prompt_cache_key:
        return affinity_key(model, "session", request.prompt_cache_key)
    if isinstance(request, ChatRequest | CompletionRequest) and request.user:
        return affinity_key(model, "user", request.user)
    if isinstance(request, CompletionRequest):
        return affinity_key(model, _completion_prompt(request))
    if isinstance(request, GenerateRequest):
        return affinity_key(model, request.system or "", request.prompt)
    system = next((translate.message_text(m) for m in request.messages if m.role in ("system", "developer")), "")
    first = next((translate.message_text(m) for m in request.messages if m.role == "user"), "")
    return affinity_key(model, system, first)


def native_schema(request: GenerateRequest) -> JSON | None:
    """The native API's `format` as a JSON schema: "json" is any JSON object."""
    if request.format is None:
        return None
    return {"type": "object"} if request.format == "json" else request.format


def _completion_prompt(request: CompletionRequest) -> str:
    return request.prompt if isinstance(request.prompt, str) else request.prompt[0]


def _native_messages(request: GenerateRequest) -> list[ChatMessage]:
    files = native_file_parts(request.files) if request.files else []
    return translate.native_messages(request.system, request.prompt, request.images or [], files)
