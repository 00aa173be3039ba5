"""The native API: POST /api/generate (the seed's first example)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from llmserver.schemas.common import Sampling, StopList


class GenerateRequest(Sampling):
    prompt: str = Field(min_length=1, description="The user's prompt.")
    system: str | None = Field(default=None, description="A system message before the prompt.")
    raw: bool = Field(default=False, description="Send the prompt as-is, without the chat template.")
    stop: StopList = Field(default_factory=list)


class GenerateResponse(BaseModel):
    response: str
    model: str
    instance_id: str
    prompt_tokens: int
    completion_tokens: int
    tokens_per_second: float
    latency_ms: float
