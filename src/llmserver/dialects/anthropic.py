"""Anthropic's Messages API answer shapes, from the chat answer a message is (`schemas/anthropic.py`).

A non-streamed message is built from the chat completion; a streamed one from the chat stream's
chunks (`engine/responses.chat_chunks`) as Anthropic's events: message_start, then per content block
(thinking, text, each tool_use) content_block_start, its deltas and content_block_stop, then
message_delta (the stop reason and the counts) and message_stop. A failure mid-stream is an `error`
event, as Anthropic sends one. Errors before the answer are Anthropic's error object (`errors.for_path`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from llmserver.dialects.responses import READING, chat_chunks, new_id
from llmserver.engine.shapes import named_sse
from llmserver.errors import anthropic_error
from llmserver.metrics.recorder import Tally

JSON = dict[str, Any]

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def usage(counts: JSON | None) -> JSON:
    counts = counts or {}
    cached = int((counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "input_tokens": int(counts.get("prompt_tokens", 0)) - cached,
        "output_tokens": int(counts.get("completion_tokens", 0)),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(finish: str | None, sequence: str | None) -> str:
    return "stop_sequence" if sequence else STOP_REASONS.get(finish or "", "end_turn")


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message(answer: JSON) -> JSON:
    """A chat completion (ours) as an Anthropic message."""
    choice = answer["choices"][0]
    chat = choice["message"]
    content: list[JSON] = []
    if chat.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""})
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in chat.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                        "input": _input(function["arguments"])})  # fmt: skip
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": answer["model"],
        "content": content,
        "stop_reason": _stop_reason(choice.get("finish_reason"), choice.get("stop_sequence")),
        "stop_sequence": choice.get("stop_sequence"),
        "usage": usage(answer.get("usage")),
    }


async def stream(
    chat: AsyncGenerator[bytes, Any], model: str, tally: Tally | None = None
) -> AsyncGenerator[bytes, Any]:
    """Anthropic's events for a chat stream (already open: its first step has run, so that `tally` holds
    the prompt's counts for `message_start`)."""
    try:
        async with aclosing(_stream(chat, model, tally)) as events:
            async for event in events:
                yield event
    finally:  # also when the client leaves, before or while it is read: the chat stream closes its ticket
        await chat.aclose()


async def _stream(chat: AsyncGenerator[bytes, Any], model: str, tally: Tally | None) -> AsyncGenerator[bytes, None]:
    counted = None
    if tally is not None and tally.prompt_tokens:
        cached = {"cached_tokens": tally.cached_tokens}
        counted = {"prompt_tokens": tally.prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": cached}
    start: JSON = {
        "id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(counted),
    }  # fmt: skip
    yield named_sse({"type": "message_start", "message": start}) + named_sse({"type": "ping"})
    index = -1
    block: str | None = None  # the kind of the block being streamed
    finish, counts, sequence = "stop", None, None

    def open_block(kind: str, content_block: JSON) -> bytes:
        nonlocal index, block
        out = close_block()
        index += 1
        block = kind
        return out + named_sse({"type": "content_block_start", "index": index, "content_block": content_block})

    def close_block() -> bytes:
        nonlocal block
        if block is None:
            return b""
        block = None
        return named_sse({"type": "content_block_stop", "index": index})

    async for chunk in chat_chunks(chat):
        out: list[bytes] = []
        if chunk is READING:  # the prompt is still being read: Anthropic's keepalive
            yield named_sse({"type": "ping"})
            continue
        if "error" in chunk:
            yield close_block() + named_sse(anthropic_error(chunk["error"]))
            return
        counts = chunk.get("usage") or counts
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if block != "thinking":
                    out.append(open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                text = delta["reasoning_content"]
                out.append(named_sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "thinking_delta", "thinking": text}}))  # fmt: skip
            if delta.get("content"):
                if block != "text":
                    out.append(open_block("text", {"type": "text", "text": ""}))
                out.append(named_sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "text_delta", "text": delta["content"]}}))  # fmt: skip
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    out.append(open_block("tool_use", {"type": "tool_use", "id": call["id"],
                                                       "name": function.get("name", ""), "input": {}}))  # fmt: skip
                if function.get("arguments"):
                    partial = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    out.append(named_sse({"type": "content_block_delta", "index": index, "delta": partial}))
            if choice.get("finish_reason"):
                finish, sequence = choice["finish_reason"], choice.get("stop_sequence")
        if out:
            yield b"".join(out)
    final = usage(counts)
    ending = {"stop_reason": _stop_reason(finish, sequence), "stop_sequence": sequence}
    yield (
        close_block()
        + named_sse({"type": "message_delta", "delta": ending, "usage": final})
        + named_sse({"type": "message_stop"})
    )
