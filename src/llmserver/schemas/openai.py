"""OpenAI-compatible request models: /v1/chat/completions and /v1/completions.

Each field of OpenAI's requests is declared here: honoured, accepted without effect (the short list
`HARMLESS`: bookkeeping fields clients send routinely), or refused with a 400 naming it (`Refused`).
Anything else is an unrecognized argument (400), as OpenAI answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from llmserver.errors import InvalidRequest, validation_error
from llmserver.schemas.common import MAX_STOP_STRINGS, AsChat, LogitBias, Sampling, StopStringOrList, Strict

# Accepted and not used: they change nothing about the answer.
HARMLESS = ("metadata", "store", "service_tier", "safety_identifier")
# Fields of an assistant message that clients copy back from an earlier answer (the OpenAI SDK, litellm,
# OpenRouter-style reasoning): accepted and ignored, but for reasoning_content (given to the template).
ECHOED = (
    "reasoning_content", "refusal", "annotations", "audio", "function_call", "reasoning", "reasoning_details",
    "thinking_blocks", "provider_specific_fields",
)  # fmt: skip
# OpenAI's reasoning_effort values; each maps to thinking on or off and a budget (engine/reasoning.py).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # images are always downscaled to image_max_side


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class FilePart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["file"]
    file: dict[str, Any]


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]
P = TypeVar("P", TextPart, ImagePart, FilePart)

FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCall(Strict):
    name: FunctionName
    arguments: str = Field(description="The arguments as a JSON object, in a string.")


class ToolCall(Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, description="Accepted; chat templates do not show it to the model.")
    tool_calls: list[ToolCall] | None = Field(default=None, description="Assistant messages: the calls it made.")
    tool_call_id: str | None = Field(default=None, description="Tool messages: the call this answers.")
    # What clients copy back of an earlier answer (ours or another server's): accepted and ignored
    # (`ECHOED`), but for `reasoning_content`, which goes to the chat template (some render it).
    reasoning_content: str | None = Field(default=None, description="Assistant messages: the model's reasoning.")
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: None = None
    reasoning: Any = None
    reasoning_details: Any = None
    thinking_blocks: Any = None
    provider_specific_fields: Any = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return self


def parts_of(messages: Sequence[ChatMessage], kind: type[P]) -> list[tuple[int, int, P]]:
    """Every content part of one type, with the index of its message and its position there."""
    return [
        (index, position, part)
        for index, message in enumerate(messages)
        if isinstance(message.content, list)
        for position, part in enumerate(message.content)
        if isinstance(part, kind)
    ]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; no effect here


class JSONSchemaFormat(Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(default=None, description="Always enforced: the grammar admits nothing else.")

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")]


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _refuse(what: str) -> Any:
    """A field OpenAI defines that this server does not do: refused when present (not null)."""
    return Field(default=None, description=f"Refused: {what}.")


class _OpenAIRequest(Sampling):
    stop: StopStringOrList | None = Field(
        default=None, description=f"Up to {MAX_STOP_STRINGS} strings that end generation."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, description="Only one choice per request (1) is supported.")
    user: str | None = Field(default=None, description="Used for prompt-cache affinity.")
    logit_bias: LogitBias | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only one choice per request is supported (n = 1)")
        return value


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_cache_key: str | None = Field(default=None, description="Used for prompt-cache affinity.")
    modalities: list[str] | None = Field(default=None, description='Only ["text"] is supported.')

    @staticmethod
    def of(chat: AsChat, **fields: Any) -> TranslatedChat:
        """The chat request another API's request amounts to (`chat`, with `fields` over its body). Its
        body is validated as any chat request's is: the chat path's own limits apply to it alike."""
        try:
            request = TranslatedChat.model_validate({**chat.body, **fields})
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        request._thinking_budget = chat.budget
        request._thinking_optional = chat.optional_thinking
        request._names_stop = chat.names_stop
        return request

    audio: Any = _refuse("audio output")
    prediction: Any = _refuse("predicted outputs")
    functions: Any = _refuse("the deprecated functions; use tools")
    function_call: Any = _refuse("the deprecated function_call; use tool_choice")
    reasoning_effort: ReasoningEffort | None = Field(
        default=None, description="For a model whose chat template thinks: thinking off (none) or its budget."
    )
    verbosity: Any = _refuse("verbosity")
    web_search_options: Any = _refuse("web search")

    @field_validator("audio", "prediction", "functions", "function_call", "verbosity", "web_search_options")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by this server")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise ValueError('only text output is supported (modalities: ["text"])')
        return value

    @model_validator(mode="after")
    def _check_together(self) -> ChatRequest:
        # Raised as our own error (pydantic lets it through) so that it names its parameter.
        if self.top_logprobs is None and self.tools is None and self.tool_choice is None:
            return self  # nothing to check together (most requests)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
        names = {tool.function.name for tool in self.tools or []}
        if len(names) != len(self.tools or []):
            raise InvalidRequest("tools: two tools share a name", param="tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice: names {choice.function.name!r}, which is not among the tools", param="tool_choice"
            )
        if choice in ("required",) and not self.tools:
            raise InvalidRequest("tool_choice: required needs tools", param="tool_choice")
        return self


class TranslatedChat(ChatRequest):
    """A chat request another API's request amounts to (`ChatRequest.of`), with what its translation
    says beyond chat's fields. Kept apart from ChatRequest: pydantic sets a model's private fields up on
    every instance it validates, and the chat path validates one per request."""

    # Set by the Anthropic Messages translation (`thinking.budget_tokens`), which has no effort levels.
    _thinking_budget: int | None = PrivateAttr(default=None)
    _thinking_optional: bool = PrivateAttr(default=False)
    _names_stop: bool = PrivateAttr(default=False)  # ask llama-server which stop sequence ended the answer


class CompletionRequest(_OpenAIRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=5, description="The n likeliest tokens at each step.")
    echo: bool | None = Field(default=None, description="Only false is supported.")
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    suffix: Any = _refuse("suffix (insertion)")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echoing the prompt is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only best_of = 1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by this server")
        return value


MAX_EMBEDDING_INPUTS = 2048

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(Strict):
    api_key: str | None = Field(default=None, description="The API key, when not sent as a Bearer token.")
    model: str | None = Field(default=None, description="An embedding model; default: the first configured one.")
    input: (
        Annotated[str, StringConstraints(min_length=1)]
        | Annotated[
            list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    ) = Field(description=f"A text, or up to {MAX_EMBEDDING_INPUTS} texts (or token-id lists), none empty.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="Only the model's own dimension is supported.")
    keep_alive: float | None = Field(
        default=None, ge=0, description="Seconds to keep the model's instance from idling out after this request."
    )
    user: str | None = None
