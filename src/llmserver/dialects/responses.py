"""The Responses API's answer shapes, from the chat answer a response is (`schemas/responses.py`).

A non-streamed response is built from the chat completion; a streamed one from the chat stream's
typed pieces as the relay makes them (`Voice`, engine/shapes.py), written as the Responses events: response.created and
response.in_progress, then for each output item (reasoning, the message, each function call) its
output_item.added, deltas and done events, and last response.completed (response.incomplete when
max_output_tokens cut it). A failure mid-stream is an `error` event followed by response.failed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from llmserver.engine import translate
from llmserver.engine.shapes import TokenEvents, named_sse
from llmserver.schemas.responses import ResponsesRequest, namespaced

JSON = dict[str, Any]
Namespaces = Mapping[str, tuple[str, str]]  # a served function name: its namespace and own name


def new_id(prefix: str) -> str:
    return translate.new_id(prefix, "_")


def usage(counts: JSON | None) -> JSON:
    """A chat usage object in the Responses shape (reasoning tokens are not counted apart by llama.cpp)."""
    counts = counts or {}
    prompt, completion = int(counts.get("prompt_tokens", 0)), int(counts.get("completion_tokens", 0))
    cached = int((counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class Response:
    """One response object: its fixed fields from the request, its output and status as they come."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = new_id("resp")
        self.created = int(time.time())
        self.request = request
        self.namespaces = namespaced(request.tools)
        self.model = model
        self.output: list[JSON] = []

    def body(self, status: str, counts: JSON | None = None, error: JSON | None = None) -> JSON:
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "store": False,
            "temperature": request.temperature,
            "text": {"format": (request.text.format if request.text else None) or {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage(counts) if counts is not None else None,
            "user": request.user,
            "metadata": request.metadata or {},
        }


def reasoning_item(text: str, status: str = "completed") -> JSON:
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(text: str, status: str = "completed") -> JSON:
    return {
        "id": new_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", namespaces: Namespaces | None = None
) -> JSON:
    """A function call output item; a function of a namespace tool is named as the client named it."""
    item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name}
    if namespaces and name in namespaces:
        item["namespace"], item["name"] = namespaces[name]
    return {**item, "arguments": arguments, "status": status}


def response(answer: JSON, request: ResponsesRequest) -> JSON:
    """A chat completion (ours) as a response object."""
    choice = answer["choices"][0]
    message = choice["message"]
    shaped = Response(request, answer["model"])
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    if message.get("reasoning_content"):
        shaped.output.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        shaped.output.append(message_item(message.get("content") or "", status))
    for call in calls:
        shaped.output.append(
            call_item(call["id"], call["function"]["name"], call["function"]["arguments"], namespaces=shaped.namespaces)
        )
    return shaped.body(status, answer.get("usage"))


class _Events:
    """The Responses events of one stream, numbered."""

    def __init__(self, shaped: Response) -> None:
        self.shaped = shaped
        self.sequence = 0
        self.item: JSON | None = None  # the output item being streamed
        self.text: list[str] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return named_sse({"type": kind, "sequence_number": self.sequence, **fields})

    @property
    def index(self) -> int:
        return len(self.shaped.output)

    def open(self, item: JSON) -> list[bytes]:
        out = self.close()
        self.item, self.text = item, []
        out.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                  content_index=0, part=part))  # fmt: skip
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        item = self.item
        if item is None:
            return []
        self.item = None
        text, at, out = "".join(self.text), self.index, []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=text))  # fmt: skip
            item = reasoning_item(text, status) | {"id": item["id"]}
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=text, logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=part))  # fmt: skip
            item = message_item(text, status) | {"id": item["id"]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=text))  # fmt: skip
            item = {**item, "arguments": text, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        self.shaped.output.append(item)
        return out

    def delta(self, kind: str, text: str) -> bytes:
        assert self.item is not None
        self.text.append(text)
        if kind == "reasoning":
            return self.event("response.reasoning_text.delta", item_id=self.item["id"], output_index=self.index,
                              content_index=0, delta=text)  # fmt: skip
        if kind == "message":
            return self.event("response.output_text.delta", item_id=self.item["id"], output_index=self.index,
                              content_index=0, delta=text, logprobs=[])  # fmt: skip
        return self.event("response.function_call_arguments.delta", item_id=self.item["id"],
                          output_index=self.index, delta=text)  # fmt: skip


class Voice:
    """The Responses events of a chat stream (engine/shapes.py `Voice`)."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.shaped = Response(request, model)
        self.events = _Events(self.shaped)
        self.finish = "stop"
        self.failed = False

    def opening(self) -> bytes:
        body = self.shaped.body("in_progress")
        return self.events.event("response.created", response=body) + self.events.event(
            "response.in_progress", response=body
        )

    def text(self, tokens: TokenEvents, raw: bytes) -> bytes:
        return self._content(orjson.loads(raw))

    def _content(self, text: str) -> bytes:
        events = self.events
        out = b""
        if events.item is None or events.item["type"] != "message":
            out = b"".join(events.open(message_item("", "in_progress")))
        return out + events.delta("message", text)

    def pieces(self, pieces: list[JSON]) -> bytes:
        events, out = self.events, []
        for choice in pieces:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if events.item is None or events.item["type"] != "reasoning":
                    out.extend(events.open(reasoning_item("", "in_progress") | {"content": []}))
                out.append(events.delta("reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                out.append(self._content(delta["content"]))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    item = call_item(call["id"], function.get("name", ""), "", "in_progress", self.shaped.namespaces)
                    out.extend(events.open(item))
                if function.get("arguments"):
                    out.append(events.delta("function_call", function["arguments"]))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return b"".join(out)

    def reading(self) -> bytes:
        # An event, not a comment: Codex's idle timeout counts events (300 s).
        return self.events.event("response.in_progress", response=self.shaped.body("in_progress"))

    def error(self, body: JSON) -> bytes:
        self.failed = True
        error, events = body["error"], self.events
        out = events.close("incomplete")
        out.append(
            events.event("error", code=error.get("type"), message=error.get("message"), param=error.get("param"))
        )
        failed = {"code": error.get("type"), "message": error.get("message")}
        out.append(events.event("response.failed", response=self.shaped.body("failed", None, failed)))
        return b"".join(out)

    def closing(self, usage: JSON | None) -> bytes:
        if self.failed:
            return b""
        events = self.events
        status = "incomplete" if self.finish == "length" else "completed"
        out = events.close(status)
        if not self.shaped.output:  # an empty answer is still one (empty) message, as a non-streamed one has
            out += events.open(message_item("", "in_progress")) + events.close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return b"".join([*out, events.event(kind, response=self.shaped.body(status, usage))])
