"""The structured-output shape the client SDK tests parse answers into (OpenAI's `response_format` with a
pydantic model, `parse`)."""

from __future__ import annotations

from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int
