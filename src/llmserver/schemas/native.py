"""The native API: POST /api/generate (the seed's first example)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from llmserver.schemas.common import Sampling, StopList


class GenerateRequest(Sampling):
    prompt: str = Field(min_length=1, description="The user's prompt.")
    system: str | None = Field(default=None, description="A system message before the prompt.")
    raw: bool = Field(default=False, description="Send the prompt as-is, without the chat template.")
    stop: StopList = Field(default_factory=list)
    images: list[str] | None = Field(
        default=None,
        description="Up to 4 images for a vision-capable model: data: URIs (base64) or public http(s) URLs.",
    )
    format: Literal["json"] | dict[str, Any] | None = Field(
        default=None,
        description='Structured output: "json" for any JSON object, or a JSON schema the response must match.',
    )
    files: list[dict[str, Any]] | None = Field(
        default=None,
        description='Up to 5 files whose text goes before the prompt, each {"type": "file", "file": '
        '{"filename", "data": "data:<mime>;base64,..."}} as in chat (or just the inner "file" object).',
    )


class GenerateResponse(BaseModel):
    response: str
    model: str
    instance_id: str
    prompt_tokens: int
    completion_tokens: int
    tokens_per_second: float
    latency_ms: float
