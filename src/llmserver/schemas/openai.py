"""OpenAI-compatible request models: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from llmserver.schemas.common import MAX_STOP_STRINGS, Sampling, StopStringOrList


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FilePart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["file"]
    file: dict[str, Any]


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]
P = TypeVar("P", TextPart, ImagePart, FilePart)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


def parts_of(messages: Sequence[ChatMessage], kind: type[P]) -> list[tuple[int, int, P]]:
    """Every content part of one type, with the index of its message and its position there."""
    return [
        (index, position, part)
        for index, message in enumerate(messages)
        if isinstance(message.content, list)
        for position, part in enumerate(message.content)
        if isinstance(part, kind)
    ]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIRequest(Sampling):
    stop: StopStringOrList | None = Field(
        default=None, description=f"Up to {MAX_STOP_STRINGS} strings that end generation."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")
    user: str | None = None


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_OpenAIRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
