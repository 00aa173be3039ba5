"""Stream events relayed unparsed (`shapes.TokenEvents`) give the very chunks the parsed path gives."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from llmserver.engine import shapes
from llmserver.engine.tools import ToolPlan
from llmserver.schemas.openai import Tool

HEAD = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
TAIL = ',"created":1796027452,"id":"chatcmpl-y","model":"M","system_fingerprint":"b0","object":"chat.completion.chunk"}'

# Texts that could fool a cut at the wrong place: the end marker, quotes, escapes, non-ASCII.
TEXTS = ["a", " tab", "", '"', '\\"', "\\", '}}],"', '"}}],"created"', ',"', '","x":1', "\n\t\u0001", "é漢🙂", "null"]


def chat_event(delta: dict[str, Any], tail: str = TAIL, **choice: Any) -> bytes:
    """A chat event as llama-server writes it (its key order, nlohmann's escaping)."""
    first = {"finish_reason": None, "index": 0, "delta": delta, **choice}
    return ('{"choices":[' + json.dumps(first, ensure_ascii=False, separators=(",", ":")) + "]" + tail).encode()


def completion_event(text: str, tail: str = ',"created":1,"model":"M","object":"text_completion","id":"c"}') -> bytes:
    first = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
    return ('{"choices":[' + json.dumps(first, ensure_ascii=False, separators=(",", ":")) + "]" + tail).encode()


def parsed(shape: shapes.StreamShape, data: bytes) -> list[Any]:
    chunk = shapes.Chunks(HEAD)
    return [orjson.loads(chunk(piece)[6:]) for piece in shape.pieces(orjson.loads(data)["choices"][0])]


def unparsed(tokens: shapes.TokenEvents, data: bytes) -> Any:
    text = tokens.text(data)
    assert text is not None, data
    out = shapes.Chunks(HEAD).token(tokens, text)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    return orjson.loads(out[6:])


@pytest.mark.parametrize("text", TEXTS)
def test_a_chat_token_event_unparsed_is_the_chunk_parsing_gives(text: str) -> None:
    shape = shapes.ChatStream(ToolPlan(native=True))
    assert shape.tokens is shapes.CHAT_TOKEN
    data = chat_event({"content": text})
    assert [unparsed(shapes.CHAT_TOKEN, data)] == parsed(shape, data)


@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_token_event_unparsed_is_the_chunk_parsing_gives(text: str) -> None:
    shape = shapes.CompletionStream(None)
    data = completion_event(text)
    assert [unparsed(shapes.COMPLETION_TOKEN, data)] == parsed(shape, data)


@pytest.mark.parametrize(
    "data",
    [
        chat_event({"role": "assistant", "content": None}),  # the role, once
        chat_event({"content": None}),
        chat_event({"content": "a", "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
        chat_event({"tool_calls": [{"index": 0, "function": {"arguments": '"}}],"'}}]}),
        chat_event({"content": "a"}, logprobs={"content": [{"token": "a", "logprob": -0.1}]}),
        chat_event({"content": "a"}, tail=',"created":1,"prompt_progress":{"total":3}}'),
        chat_event({"content": "a"}, tail=',"created":1,"usage":{"prompt_tokens":3,"completion_tokens":1}}'),
        chat_event({}, finish_reason="length"),
        b'{"choices":[],"created":1,"usage":{"prompt_tokens":3}}',
    ],
)
def test_every_other_chat_event_is_parsed(data: bytes) -> None:
    assert shapes.CHAT_TOKEN.text(data) is None


def test_completion_progress_and_final_events_are_parsed() -> None:
    assert shapes.COMPLETION_TOKEN.text(completion_event("", tail=',"prompt_progress":{"total":1}}')) is None
    final = b'{"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"usage":{}}'
    assert shapes.COMPLETION_TOKEN.text(final) is None
    with_logprobs = b'{"choices":[{"text":"a","index":0,"logprobs":{"content":[]},"finish_reason":null}],"id":"c"}'
    assert shapes.COMPLETION_TOKEN.text(with_logprobs) is None


def test_streams_whose_text_is_held_back_or_reshaped_are_always_parsed() -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
    prompted = ToolPlan(native=False, tools=[tool])
    assert prompted.prompted and shapes.ChatStream(prompted).tokens is None
    assert shapes.CompletionStream(shapes.translate.LegacyLogprobs(1, "x")).tokens is None
