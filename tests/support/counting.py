"""Streams that count, for the tests of streams that give their slot back and go on (fair shares bounded
in time): a completion of "1, 2, 3, 4," continues the count, so a token lost or repeated where a stream
stopped and went on shows as a gap or a repeat."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import openai

from tests.support import MODEL, Server

COUNT_FROM = "1, 2, 3, 4,"


def consecutive(text: str) -> list[str]:
    """The numbers of a count that continues "1, 2, 3, 4,"; fails on a gap or a repeat (the last number may
    be cut short by max_tokens)."""
    numbers = [part.strip() for part in (COUNT_FROM + text).split(",") if part.strip()]
    expected = [str(n) for n in range(1, len(numbers) + 1)]
    assert numbers[:-1] == expected[:-1] and expected[-1].startswith(numbers[-1]), text
    return numbers


Result = tuple[str, str | None, tuple[int, int]]  # text, finish reason, (prompt tokens, completion tokens)


def openai_client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def openai_stream(stream: Iterable[Any], text_of: Callable[[Any], str | None]) -> Result:
    """An OpenAI SDK stream's text (`text_of` a choice), finish reason and usage."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += text_of(chunk.choices[0]) or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return text, finish, (usage.prompt_tokens, usage.completion_tokens)


def completion_stream(server: Server, key: str, max_tokens: int) -> Result:
    stream = openai_client(server, key).completions.create(
        model=MODEL, prompt=COUNT_FROM, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    return openai_stream(stream, lambda choice: choice.text)
