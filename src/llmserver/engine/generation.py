"""The generation service: validated requests in, responses out, through a routed instance.

Routers call one method here per endpoint. Streams are opened (and their first event awaited)
before the HTTP response starts, so an error that llama-server reports up front (an over-long
prompt, say) is still an ordinary HTTP error; once streaming, a failure becomes one error event
followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from llmserver.auth.keys import Principal
from llmserver.engine import translate
from llmserver.engine.client import LlamaServerClient
from llmserver.errors import APIError, GatewayTimeout, InstanceUnavailable, InvalidRequest, ServerError, UpstreamError
from llmserver.inputs import documents as files
from llmserver.inputs.documents import DocumentService
from llmserver.inputs.images import IMAGE_TOKEN_ALLOWANCE, ImageService
from llmserver.inputs.images import count_check as image_count_check
from llmserver.metrics.recorder import Tally, UsageRecorder
from llmserver.pool.router import Router
from llmserver.schemas.common import Sampling
from llmserver.schemas.native import GenerateRequest, GenerateResponse
from llmserver.schemas.openai import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    FilePart,
    ImagePart,
    ImageURL,
    parts_of,
)
from llmserver.settings import Settings

log = logging.getLogger(__name__)

JSON = dict[str, Any]
DONE = b"data: [DONE]\n\n"


def sse(event: JSON) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def prompt_bound(payload: JSON) -> int:
    """An upper bound of the prompt's tokens without tokenizing: a token is at least one UTF-8 byte
    (byte-level BPE), plus room for the chat template's own tokens (a default system prompt included)."""
    if "messages" in payload:
        return 64 + sum(8 + _content_bound(m.get("content")) for m in payload["messages"])
    return 8 + len(str(payload.get("prompt", "")).encode())


def _content_bound(content: Any) -> int:
    if isinstance(content, list):  # text and image parts: an image counts its allowance, not its bytes
        return sum(
            IMAGE_TOKEN_ALLOWANCE if part.get("type") == "image_url" else len(str(part.get("text", "")).encode())
            for part in content
        )
    return len(str(content or "").encode())


class GenerationService:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        recorder: UsageRecorder,
        documents: DocumentService,
        images: ImageService,
    ) -> None:
        self.settings = settings
        self.router = router
        self.recorder = recorder
        self.documents = documents
        self.images = images
        self.vision_models = {model.name for model in settings.models if model.vision_capable}
        self.default_model = settings.models[0].name

    def _open(self, principal: Principal, endpoint: str, model: str, payload: JSON) -> Tally:
        """The key's rate and quota checks (before anything is sent anywhere), and the request's tally."""
        try:
            self.recorder.quota.check_rate(principal)
            reservation = self.recorder.quota.reserve(principal, prompt_bound(payload) + int(payload["max_tokens"]))
        except APIError as exc:
            self.recorder.metrics.quota_rejections.labels(exc.type).inc()
            raise
        return Tally(principal, endpoint, model, reservation)

    def _model(self, request: Sampling) -> str:
        name = request.model or self.default_model
        self.router.check_model(name)
        return name

    def _max_tokens(self, requested: int | None, param: str = "max_tokens") -> int:
        limit = self.settings.max_tokens_limit
        if requested is None:
            return self.settings.default_max_tokens
        if requested > limit:
            raise InvalidRequest(f"{param} is {requested}; this server allows at most {limit}.", param=param)
        return requested

    async def _call(self, tally: Tally, path: str, payload: JSON) -> JSON:
        """One non-streamed call, accounted in `tally`; retried once if the instance died before answering."""
        with self._closed_on_failure(tally):
            body = await self._call_once_or_twice(tally, path, payload)
        counts = translate.usage(body)
        tally.prompt_tokens, tally.completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
        prompt_ms = (body.get("timings") or {}).get("prompt_ms")
        if isinstance(prompt_ms, int | float):
            tally.ttft = prompt_ms / 1000
            self.recorder.metrics.ttft.labels(tally.model).observe(tally.ttft)
        self.recorder.close(tally, "ok")
        return body

    @contextmanager
    def _closed_on_failure(self, tally: Tally) -> Iterator[None]:
        """Account a request that fails before it produced anything: settled to nothing, outcome recorded."""
        try:
            yield
        except APIError as exc:
            self.recorder.close(tally, exc.type)
            raise
        except BaseException:
            self.recorder.close(tally, "cancelled")
            raise

    async def _call_once_or_twice(self, tally: Tally, path: str, payload: JSON) -> JSON:
        for attempt in (1, 2):
            try:
                async with self._instance(tally) as client:
                    return await client.post_json(path, payload)
            except InstanceUnavailable:
                if attempt == 2:
                    raise
                log.warning("instance %s failed under a request; retrying it once", tally.instance_id)
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def _instance(self, tally: Tally) -> AsyncIterator[LlamaServerClient]:
        """A slot on an instance of the tally's model for the block, bounded by request_timeout.

        An instance that cannot be reached is reported to the supervisor (it may have died)."""
        async with self.router.lease(tally.model, tally.principal) as instance:
            tally.instance_id = instance.id
            try:
                if instance.client is None:
                    raise InstanceUnavailable("The instance went away.")
                async with asyncio.timeout(self.settings.request_timeout):
                    yield instance.client
            except TimeoutError:
                raise GatewayTimeout(
                    f"The generation did not finish within {self.settings.request_timeout:.0f} s."
                ) from None
            except InstanceUnavailable:
                self.router.instance_failed(instance)
                raise

    # Native API

    async def generate(self, principal: Principal, request: GenerateRequest) -> GenerateResponse:
        model = self._model(request)
        payload = translate.sampling_payload(request, self._max_tokens(request.max_tokens), request.stop)
        started = time.perf_counter()
        if request.images and request.raw:
            raise InvalidRequest("Images need the chat template: they cannot be sent with raw: true.", param="images")
        # The cheap checks on every image and file first, before anything is fetched or extracted.
        self._check_images(len(request.images or []), model, "images")
        uploads = await asyncio.to_thread(files.native_uploads, request.files) if request.files else []
        images = await asyncio.gather(
            *(self.images.prepare(url, f"images.{index}") for index, url in enumerate(request.images or []))
        )
        prompt = request.prompt
        if uploads:
            blocks = [files.render(e) for e in await self.documents.extract_all(uploads)]
            prompt = "\n".join([*blocks, prompt])
        if request.raw:
            system = f"{request.system}\n\n" if request.system else ""
            payload["prompt"] = system + prompt
            tally = self._open(principal, "/api/generate", model, payload)
            body = await self._call(tally, "/v1/completions", payload)
            text = _choice(body).get("text", "")
        else:
            messages = translate.native_messages(request.system, prompt, [image.data_uri for image in images])
            payload["messages"] = translate.chat_messages(messages)
            tally = self._open(principal, "/api/generate", model, payload)
            body = await self._call(tally, "/v1/chat/completions", payload)
            text = (_choice(body).get("message") or {}).get("content") or ""
        instance_id = tally.instance_id or ""
        latency = time.perf_counter() - started
        counts = translate.usage(body)
        return GenerateResponse(
            response=text,
            model=model,
            instance_id=instance_id,
            prompt_tokens=counts["prompt_tokens"],
            completion_tokens=counts["completion_tokens"],
            # As the seed defines it: completion tokens over the whole request's latency.
            tokens_per_second=round(counts["completion_tokens"] / latency, 2) if latency > 0 else 0.0,
            latency_ms=round(latency * 1000, 1),
        )

    # OpenAI chat

    def _chat_payload(self, request: ChatRequest, model: str) -> JSON:
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(request.max_completion_tokens or request.max_tokens, param)
        return translate.chat_payload(request, max_tokens, stream=request.stream)

    async def check_inputs(self, request: ChatRequest | GenerateRequest) -> None:
        """The checks on attached images and files that need no fetching or extraction (run before an
        async job is accepted, so that such a request is refused at once)."""
        model = self._model(request)
        if isinstance(request, ChatRequest):
            self._image_parts(request.messages, model)
            await asyncio.to_thread(files.chat_uploads, request.messages)
            return
        self._check_images(len(request.images or []), model, "images")
        if request.files:
            await asyncio.to_thread(files.native_uploads, request.files)

    def _check_images(self, count: int, model: str, param: str) -> None:
        """400 for images sent to a text-only model, or for too many of them."""
        if count and model not in self.vision_models:
            raise InvalidRequest(
                f"The model {model!r} is not vision-capable: it does not accept image parts.", param=param
            )
        image_count_check(count, param)

    def _image_parts(self, messages: list[ChatMessage], model: str) -> list[tuple[int, int, ImagePart]]:
        """Every image part of the messages with its place, checked."""
        found = parts_of(messages, ImagePart)
        if found:
            index, position, _ = found[0]
            self._check_images(len(found), model, f"messages.{index}.content.{position}")
        return found

    async def _with_inputs(self, request: ChatRequest, model: str) -> ChatRequest:
        """The request with file parts replaced by their text blocks and images by the ones we made."""
        messages = request.messages
        if not any(isinstance(m.content, list) for m in messages):
            return request
        # The cheap checks on every image and file first, before anything is fetched or extracted;
        # decoding and sniffing up to 75 MB of files is real work, so off the event loop.
        found = self._image_parts(messages, model)
        has_files = bool(parts_of(messages, FilePart))
        uploads = await asyncio.to_thread(files.chat_uploads, messages) if has_files else []
        if found:
            messages = await self._replace_images(messages, found)
        if uploads:
            extracted = await self.documents.extract_all([upload for _, upload in uploads])
            messages = files.merged_messages(messages, [index for index, _ in uploads], extracted)
        return request.model_copy(update={"messages": messages})

    async def _replace_images(
        self, messages: list[ChatMessage], found: list[tuple[int, int, ImagePart]]
    ) -> list[ChatMessage]:
        """The messages with each image part pointing at the image we fetched, checked and downscaled."""
        prepared = await asyncio.gather(
            *(
                self.images.prepare(part.image_url.url, f"messages.{index}.content.{position}.image_url.url")
                for index, position, part in found
            )
        )
        replaced = {(index, position): image for (index, position, _), image in zip(found, prepared, strict=True)}
        result = []
        for index, message in enumerate(messages):
            if isinstance(message.content, list):
                parts = [
                    ImagePart(type="image_url", image_url=ImageURL(url=replaced[index, position].data_uri))
                    if (index, position) in replaced
                    else part
                    for position, part in enumerate(message.content)
                ]
                message = message.model_copy(update={"content": parts})
            result.append(message)
        return result

    async def chat(self, principal: Principal, request: ChatRequest) -> JSON:
        model = self._model(request)
        request = await self._with_inputs(request, model)
        payload = self._chat_payload(request, model)
        body = await self._call(
            self._open(principal, "/v1/chat/completions", model, payload), "/v1/chat/completions", payload
        )
        choice = _choice(body)
        message = choice.get("message") or {}
        return {
            **translate.head("chatcmpl", "chat.completion", model),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": message.get("content") or ""},
                    "finish_reason": translate.finish_reason(choice.get("finish_reason")),
                }
            ],
            "usage": translate.usage(body),
        }

    async def chat_stream(self, principal: Principal, request: ChatRequest) -> AsyncIterator[bytes]:
        model = self._model(request)
        request = await self._with_inputs(request, model)
        payload = self._chat_payload(request, model)
        head = translate.head("chatcmpl", "chat.completion.chunk", model)

        def chunk(choice: JSON) -> JSON:
            delta = choice.get("delta") or {}
            out: JSON = {}
            if delta.get("role"):
                out["role"] = delta["role"]
            if delta.get("content") is not None:
                out["content"] = delta["content"]
            reason = choice.get("finish_reason")
            return {
                "index": 0,
                "delta": out,
                "finish_reason": translate.finish_reason(reason) if reason else None,
            }

        tally = self._open(principal, "/v1/chat/completions", model, payload)
        return await self._stream(tally, "/v1/chat/completions", payload, head, chunk, request)

    # OpenAI legacy completions

    def _completion_payload(self, request: CompletionRequest) -> JSON:
        payload = translate.sampling_payload(request, self._max_tokens(request.max_tokens), request.stop)
        payload["prompt"] = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
        payload["stream"] = request.stream
        if request.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    async def completion(self, principal: Principal, request: CompletionRequest) -> JSON:
        model = self._model(request)
        payload = self._completion_payload(request)
        body = await self._call(self._open(principal, "/v1/completions", model, payload), "/v1/completions", payload)
        choice = _choice(body)
        return {
            **translate.head("cmpl", "text_completion", model),
            "choices": [
                {
                    "text": choice.get("text", ""),
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": translate.finish_reason(choice.get("finish_reason")),
                }
            ],
            "usage": translate.usage(body),
        }

    async def completion_stream(self, principal: Principal, request: CompletionRequest) -> AsyncIterator[bytes]:
        model = self._model(request)
        head = translate.head("cmpl", "text_completion", model)

        def chunk(choice: JSON) -> JSON:
            reason = choice.get("finish_reason")
            return {
                "text": choice.get("text") or "",
                "index": 0,
                "logprobs": None,
                "finish_reason": translate.finish_reason(reason) if reason else None,
            }

        payload = self._completion_payload(request)
        tally = self._open(principal, "/v1/completions", model, payload)
        return await self._stream(tally, "/v1/completions", payload, head, chunk, request)

    # Streaming machinery shared by both OpenAI endpoints

    async def _stream(
        self,
        tally: Tally,
        path: str,
        payload: JSON,
        head: JSON,
        chunk: Callable[[JSON], JSON],
        request: ChatRequest | CompletionRequest,
    ) -> AsyncIterator[bytes]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        # Progress events carry the prompt's token count up front: a client that leaves early is
        # still charged for its prompt, not only for the tokens it received.
        payload = {**payload, "return_progress": True}
        with self._closed_on_failure(tally):
            for attempt in (1, 2):
                events = self._events(tally, path, payload)
                try:
                    first = await anext(events)
                    break
                except StopAsyncIteration:
                    raise UpstreamError("The instance closed the stream without sending anything.") from None
                except InstanceUnavailable:
                    await events.aclose()
                    if attempt == 2:
                        raise
                    log.warning("instance failed before the stream started; retrying it once")
                except BaseException:
                    await events.aclose()
                    raise

        async def body() -> AsyncIterator[bytes]:
            outcome = "client_closed"
            sent_any = False
            try:
                event: JSON | None = first
                while event is not None:
                    progress = event.get("prompt_progress")
                    if isinstance(progress, dict):
                        tally.prompt_tokens = int(progress.get("total") or 0)
                    choices = event.get("choices") or []
                    if "usage" in event:
                        counts = translate.usage(event)
                        tally.prompt_tokens, tally.completion_tokens = (
                            counts["prompt_tokens"],
                            counts["completion_tokens"],
                        )
                    if choices and not (progress is not None and sent_any):
                        piece = chunk(choices[0])
                        if piece.get("text") or (piece.get("delta") or {}).get("content"):
                            tally.completion_tokens += 1  # one token per event; the final usage corrects it
                            self.recorder.token(tally)
                        sent_any = True
                        yield sse({**head, "choices": [piece]})
                    elif not choices and "usage" in event and include_usage:
                        yield sse({**head, "choices": [], "usage": translate.usage(event)})
                    event = await anext(events, None)
                outcome = "ok"
            except APIError as exc:
                outcome = exc.type
                yield sse(exc.body())
            except Exception:
                outcome = "server_error"
                log.exception("a stream failed")
                yield sse(ServerError("The stream failed.").body())
            finally:
                await events.aclose()
                self.recorder.close(tally, outcome)
            yield DONE

        return body()

    async def _events(self, tally: Tally, path: str, payload: JSON) -> AsyncGenerator[JSON]:
        async with self._instance(tally) as client:
            async for event in client.stream(path, payload):
                yield event


def _choice(body: JSON) -> JSON:
    choices = body.get("choices") or [{}]
    first = choices[0]
    return first if isinstance(first, dict) else {}
