"""POST /v1/embeddings: admission, the slot, llama-server's embedding call, OpenAI's shape.

Embeddings are served by models configured with `embedding = true`, whose instances run in
llama-server's embedding mode (and serve nothing else). Every input is counted in the quota bound
before anything is sent; the prompt tokens llama-server reports are what is charged.
"""

from __future__ import annotations

from typing import Any

from llmserver.auth.keys import Principal
from llmserver.engine import translate
from llmserver.engine.calls import InstanceCalls
from llmserver.engine.generation import check_keep_alive
from llmserver.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, UpstreamError
from llmserver.inputs.prepare import text_bound
from llmserver.pool.admission import Admission, Ticket, outcome_of
from llmserver.pool.instance import slot_context
from llmserver.schemas.openai import EmbeddingRequest
from llmserver.settings import ModelConfig, Settings

JSON = dict[str, Any]
ENDPOINT = "/v1/embeddings"
# Room around each input (the BOS and EOS tokens an embedding model adds).
INPUT_TOKENS = 4


class EmbeddingService:
    def __init__(
        self, settings: Settings, admission: Admission, calls: InstanceCalls, models: list[ModelConfig] | None = None
    ) -> None:
        self.admission = admission
        self.calls = calls
        self.use_models(settings.models if models is None else models)  # the configured ones unless told
        self.max_keep_alive = settings.limits.max_keep_alive

    def use_models(self, models: list[ModelConfig]) -> None:
        """The models served now (at start, and after each change to the model catalog)."""
        self.models = {model.name: model for model in models if model.embedding}
        self.chat_models = {model.name for model in models if not model.embedding}

    def _model(self, requested: str | None) -> str:
        if requested is None:
            if not self.models:
                raise InvalidRequest(
                    "This server has no embedding model: configure one with embedding = true.", param="model"
                )
            return next(iter(self.models))
        if requested in self.chat_models:
            raise InvalidRequest(
                f"The model {requested!r} is a chat model; embeddings come from models configured with "
                f"embedding = true ({', '.join(self.models) or 'none here'}).",
                param="model",
            )
        if requested not in self.models:
            raise ModelNotFound(f"The model {requested!r} does not exist.", param="model")
        return requested

    async def admit(self, principal: Principal, request: EmbeddingRequest) -> Ticket:
        model = self._model(request.model)
        context = self.context(model)
        bound = 0
        for index, item in enumerate(_inputs(request)):
            tokens = len(item) if isinstance(item, list) else text_bound(item) + INPUT_TOKENS
            if isinstance(item, list) and tokens > context:
                raise InvalidRequest(
                    f"input[{index}] is {tokens} tokens; {model!r} embeds at most {context} tokens per input.",
                    param="input",
                )
            bound += min(tokens, context)
        keep_alive = check_keep_alive(request.keep_alive, self.max_keep_alive)
        return await self.admission.admit(principal, ENDPOINT, model, bound, keep_alive=keep_alive)

    def context(self, model: str) -> int:
        """Tokens one input may hold: the slot's context, and no more than one batch (ctx_size)."""
        config = self.models[model]
        return min(slot_context(config), config.ctx_size)

    async def embed(self, ticket: Ticket, request: EmbeddingRequest) -> JSON:
        try:
            await self.admission.take_slot(ticket)
            payload = {"input": request.input, "encoding_format": request.encoding_format}
            try:
                body = await self.calls.call(ticket, ENDPOINT, payload)
            except InvalidRequest as exc:
                # llama-server names no parameter: its pooling is the model's (configured, or the GGUF's)
                if exc.param is None:
                    exc.param = "model" if "pooling" in exc.message.lower() else "input"
                raise
            except UpstreamError:
                context = self.context(ticket.model)
                if any(text_bound(item) > context for item in _inputs(request) if isinstance(item, str)):
                    # llama-server refuses an input longer than its batch with a plain 500
                    raise ContextLengthExceeded(
                        f"An input is longer than the {context} tokens {ticket.model!r} embeds at once.",
                        param="input",
                    ) from None
                raise
            data = [item for item in body.get("data") or [] if isinstance(item, dict)]
            _check_dimensions(request, data)
        except BaseException as exc:
            ticket.close(outcome_of(exc))
            raise
        prompt = translate.usage(body)["prompt_tokens"]
        ticket.tally.prompt_tokens = prompt
        ticket.close("ok")
        await ticket.shared()
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": int(item.get("index", i)), "embedding": item.get("embedding")}
                for i, item in enumerate(data)
            ],
            "model": ticket.model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }


def _inputs(request: EmbeddingRequest) -> list[str | list[int]]:
    items: list[str | list[int]] = []
    value = request.input
    if isinstance(value, str):
        items.append(value)
    elif all(isinstance(item, int) for item in value):
        items.append([int(item) for item in value if isinstance(item, int)])
    else:
        items.extend(item for item in value if isinstance(item, str | list))
    return items


def _check_dimensions(request: EmbeddingRequest, data: list[JSON]) -> None:
    if request.dimensions is None or not data:
        return
    vector = data[0].get("embedding")
    # base64 holds 4 bytes (one float32) per dimension
    size = len(vector) if isinstance(vector, list) else len(str(vector)) * 3 // 4 // 4
    if size != request.dimensions:
        raise InvalidRequest(
            f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened.",
            param="dimensions",
        )
