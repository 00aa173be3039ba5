"""Anthropic's Messages API answer shapes, from the chat answer a message is (`schemas/anthropic.py`).

A non-streamed message is built from the chat completion; a streamed one from the chat stream's typed
pieces as the relay makes them (`Voice`, engine/shapes.py), written as Anthropic's events:
message_start, then per content block (thinking, text, each tool_use) content_block_start, its deltas
and content_block_stop, then message_delta (the stop reason and the counts) and message_stop. A failure
mid-stream is an `error` event, as Anthropic sends one. Errors before the answer are Anthropic's error
object (`errors.for_path`).
"""

from __future__ import annotations

import json
from typing import Any

from llmserver.dialects.responses import new_id
from llmserver.engine.shapes import TokenEvents, named_sse
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


class Voice:
    """Anthropic's events for a chat stream (engine/shapes.py `Voice`); `tally` holds the prompt's counts
    by the time the stream opens, for `message_start`."""

    def __init__(self, model: str, tally: Tally | None = None) -> None:
        self.model, self.tally = model, tally
        self.index = -1
        self.block: str | None = None  # the kind of the block being streamed
        self.finish, self.sequence = "stop", None
        self.failed = False

    def opening(self) -> bytes:
        tally, counted = self.tally, None
        if tally is not None and tally.prompt_tokens:
            cached = {"cached_tokens": tally.cached_tokens}
            counted = {"prompt_tokens": tally.prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": cached}
        start: JSON = {
            "id": new_id("msg"), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(counted),
        }  # fmt: skip
        return named_sse({"type": "message_start", "message": start}) + PING

    def _open(self, kind: str, content_block: JSON) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + named_sse({"type": "content_block_start", "index": self.index, "content_block": content_block})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return named_sse({"type": "content_block_stop", "index": self.index})

    def text(self, tokens: TokenEvents, raw: bytes) -> bytes:
        """A token's text into a text_delta as llama-server wrote its JSON string: never parsed."""
        out = b"" if self.block == "text" else self._open("text", {"type": "text", "text": ""})
        return b"%s%s%d%s%s%s" % (out, TEXT_DELTA[0], self.index, TEXT_DELTA[1], raw, TEXT_DELTA[2])

    def pieces(self, pieces: list[JSON]) -> bytes:
        out: list[bytes] = []
        for choice in pieces:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.block != "thinking":
                    out.append(self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                text = delta["reasoning_content"]
                out.append(named_sse({"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "thinking_delta", "thinking": text}}))  # fmt: skip
            if delta.get("content"):
                if self.block != "text":
                    out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(named_sse({"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "text_delta", "text": delta["content"]}}))  # fmt: skip
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    out.append(self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                                       "name": function.get("name", ""), "input": {}}))  # fmt: skip
                if function.get("arguments"):
                    partial = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    out.append(named_sse({"type": "content_block_delta", "index": self.index, "delta": partial}))
            if choice.get("finish_reason"):
                self.finish, self.sequence = choice["finish_reason"], choice.get("stop_sequence")
        return b"".join(out)

    def reading(self) -> bytes:
        return PING  # the prompt is still being read: Anthropic's keepalive

    def error(self, body: JSON) -> bytes:
        self.failed = True
        return self._close() + named_sse(anthropic_error(body["error"]))

    def closing(self, counts: JSON | None) -> bytes:
        if self.failed:
            return b""
        ending = {"stop_reason": _stop_reason(self.finish, self.sequence), "stop_sequence": self.sequence}
        return (
            self._close()
            + named_sse({"type": "message_delta", "delta": ending, "usage": usage(counts)})
            + named_sse({"type": "message_stop"})
        )


PING = named_sse({"type": "ping"})
# A text_delta event around its index and its text (a JSON string), as named_sse writes it.
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":',
    b',"delta":{"type":"text_delta","text":',
    b"}}\n\n",
)
