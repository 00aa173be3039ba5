"""Anthropic's Messages API request (`POST /v1/messages`), read as the chat request it amounts to.

`system` becomes the system message; each message's content blocks become chat messages (a user
turn's tool_result blocks one tool message each, before its other content; an assistant turn's
tool_use blocks its tool calls, its thinking block its reasoning_content); images and documents
become our image and file parts; `thinking` becomes thinking on (with its budget) or off. Every
field is honoured, accepted without effect, or refused with a 400 naming it (docs/api/anthropic.md
has the table).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from llmserver.errors import InvalidRequest
from llmserver.schemas.common import AsChat, AsChatRequest, Strict, absent, refused, string_field

JSON = dict[str, Any]

# A chat parameter → its name in a Messages request (for the errors).
PARAMS = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "reasoning_effort": "thinking",
    "response_format": "output_config.format",
}
# Anthropic's server tools (web search, code execution, …) are typed `<name>_<date>`; ours are "custom".
# Besides what makes a tool, what the API defines for one and changes no answer here: strict schemas
# (every call is held to the schema anyway), streaming and loading hints, examples, who may call it.
CUSTOM_TOOL_FIELDS = {
    "type", "name", "description", "input_schema", "cache_control", "strict", "eager_input_streaming",
    "input_examples", "defer_loading", "allowed_callers",
}  # fmt: skip
# What a block may carry besides its content, and has no effect here: prompt caching, citations.
NO_EFFECT = {"cache_control", "citations"}


class Metadata(Strict):
    user_id: str | None = Field(default=None, description="Used for prompt-cache affinity.")


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: str | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: JSON = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(AsChatRequest):
    api_key: str | None = Field(default=None, description="The API key, when not sent as x-api-key or Bearer.")
    model: str | None = Field(default=None, description="Model name; default: the first configured model.")
    max_tokens: int = Field(ge=1)
    messages: list[JSON] = Field(min_length=1)
    system: str | list[JSON] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[JSON] | None = Field(default=None, max_length=128)
    tool_choice: JSON | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    keep_alive: float | None = Field(default=None, ge=0)
    # Accepted without effect.
    service_tier: str | None = None
    cache_control: JSON | None = Field(default=None, description="Accepted; llama.cpp caches prompts by itself.")
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    context_management: Any = Field(
        default=None, description="Accepted; a beta optimisation (clearing old tool results) that changes no answer."
    )
    # Refused by name.
    container: Any = refused("code-execution containers")
    mcp_servers: Any = refused("MCP servers")
    diagnostics: Any = refused("diagnostics")

    @field_validator("container", "mcp_servers", "diagnostics")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return absent(cls, value, info)

    def chat(self) -> AsChat:
        """The chat request this is."""
        chat_messages, origins = messages(self.system, self.messages)
        body: JSON = {
            "model": self.model,
            "messages": chat_messages,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "keep_alive": self.keep_alive,
            "user": self.metadata.user_id if self.metadata else None,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [_tool(tool, index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_tool_choice(self.tool_choice))
        budget, names = None, PARAMS
        effort = self.output_config.effort if self.output_config else None
        # Only `thinking: enabled` demands thinking; `adaptive` and an effort alone let the model think if
        # it can, so a model that cannot answers without (Claude Code sends both by default).
        optional = self.thinking is None or self.thinking.type == "adaptive"
        if self.thinking is not None:
            body["reasoning_effort"] = "none" if self.thinking.type == "disabled" else effort or "high"
            budget = self.thinking.budget_tokens if self.thinking.type == "enabled" else None
        elif effort is not None:
            body["reasoning_effort"] = "xhigh" if effort == "max" else effort
            names = {**PARAMS, "reasoning_effort": "output_config.effort"}
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        chat_body = {name: value for name, value in body.items() if value is not None}
        named = bool(self.stop_sequences)
        return AsChat(chat_body, origins, names, budget, optional_thinking=optional, names_stop=named)


def messages(system: str | list[JSON] | None, given: list[JSON]) -> tuple[list[JSON], list[str]]:
    """The chat messages of a Messages request, and the parameter each came from."""
    out: list[JSON] = []
    origins: list[str] = []
    if system:
        text = system if isinstance(system, str) else _texts(system, "system")
        out.append({"role": "system", "content": text})
        origins.append("system")
    for index, message in enumerate(given):
        where = f"messages.{index}"
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise InvalidRequest(f"{where}.role: must be user, assistant or system", param=f"{where}.role")
        unknown = set(message) - {"role", "content"}
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{min(unknown)}", param=where)
        content = message.get("content")
        if role == "system":
            _system_turn(out, origins, content if isinstance(content, str) else _texts(content, f"{where}.content"),
                         where)  # fmt: skip
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            origins.append(where)
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"{where}.content: a string or a list of content blocks", param=f"{where}.content")
        converted = _assistant(content, where) if role == "assistant" else _user(content, where)
        out.extend(converted)
        origins.extend([where] * len(converted))
    return out, origins


def _system_turn(out: list[JSON], origins: list[str], text: str, where: str) -> None:
    """A `system` message among the turns (as Anthropic's API allows): before any turn, part of the
    system prompt; later, a note in the user's turn, since chat templates take one system message and
    only first — and the prompt before it stays as it was, cached."""
    if all(message["role"] == "system" for message in out):
        if out:
            out[0]["content"] += "\n\n" + text
        else:
            out.append({"role": "system", "content": text})
            origins.append(where)
        return
    note = {"type": "text", "text": f"<system>\n{text}\n</system>"}
    last = out[-1]
    if last["role"] == "user":
        if isinstance(last["content"], str):
            last["content"] = [{"type": "text", "text": last["content"]}]
        last["content"].append(note)
        return
    out.append({"role": "user", "content": [note]})
    origins.append(where)


def _user(blocks: list[Any], where: str) -> list[JSON]:
    """A user turn's blocks: its tool results (one tool message each), then the rest as one user message."""
    results: list[JSON] = []
    parts: list[JSON] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "tool_result":
            content = block.get("content")
            text = content if isinstance(content, str) else _result_texts(content or [], f"{at}.content", parts)
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at), "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": string_field(block, "text", at)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "document":
            parts.append(_document(block, at))
        elif kind in ("file", "image_url"):
            parts.append(block)  # our chat parts, as /v1/chat/completions takes them
        else:
            raise InvalidRequest(f"{at}.type: {kind!r} blocks are not supported in a user turn", param=f"{at}.type")
    if parts or not results:  # `content: []` is an empty turn, as Anthropic's API takes it
        results.append({"role": "user", "content": parts or ""})
    return results


def _assistant(blocks: list[Any], where: str) -> list[JSON]:
    texts: list[str] = []
    calls: list[JSON] = []
    reasoning: list[str] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "text":
            texts.append(string_field(block, "text", at))
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise InvalidRequest(f"{at}.input: an object is required", param=f"{at}.input")
            calls.append({
                "id": string_field(block, "id", at), "type": "function",
                "function": {"name": string_field(block, "name", at), "arguments": json.dumps(arguments)},
            })  # fmt: skip
        elif kind == "thinking":
            reasoning.append(string_field(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # another server's encrypted thinking: nothing to show a template
        else:
            raise InvalidRequest(f"{at}.type: {kind!r} blocks are not supported in an assistant turn",
                                 param=f"{at}.type")  # fmt: skip
    message: JSON = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return [message]


def _blocks(blocks: list[Any], where: str) -> list[tuple[str, str, JSON]]:
    """A turn's content blocks, each with its place and its type."""
    return [(f"{where}.content.{index}", _kind(block, f"{where}.content.{index}"), block) for index, block in
            enumerate(blocks)]  # fmt: skip


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{at}: a content block is an object with a type", param=at)
    return str(block["type"])


def _texts(blocks: Any, at: str) -> str:
    """Text blocks (system, a tool result) as one text; any other block is refused."""
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{at}: a string or a list of text blocks", param=at)
    texts = []
    for index, block in enumerate(blocks):
        if _kind(block, f"{at}.{index}") != "text":
            raise InvalidRequest(f"{at}.{index}.type: only text blocks are supported here", param=f"{at}.{index}.type")
        texts.append(string_field(block, "text", f"{at}.{index}"))
    return "\n".join(texts)


def _result_texts(blocks: Any, at: str, parts: list[JSON]) -> str:
    """A tool result's text; its images and documents (Claude Code's Read of a PNG or a PDF) go to the
    user turn's parts after it, introduced by a text part (a tool message holds text only): a model that
    cannot see images refuses them there."""
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{at}: a string or a list of blocks", param=at)
    texts, shown = [], []
    for index, block in enumerate(blocks):
        kind, where = _kind(block, f"{at}.{index}"), f"{at}.{index}"
        if kind == "text":
            texts.append(string_field(block, "text", where))
        elif kind == "image":
            shown.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}})
        elif kind == "document":
            shown.append(_document(block, where))
        else:
            raise InvalidRequest(f"{where}.type: a tool result holds text, image and document blocks",
                                 param=f"{where}.type")  # fmt: skip
    if shown:
        parts.extend([{"type": "text", "text": "(What the tool result above shows:)"}, *shown])
    return "\n".join(texts)


def _image_url(source: Any, at: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequest(f"{at}.source: an image source is base64 or url", param=f"{at}.source")


def _document(block: JSON, at: str) -> JSON:
    """A document block as our file part: its bytes extracted to text as any file's are."""
    source = block.get("source")
    name = block.get("title") if isinstance(block.get("title"), str) else "document"
    if isinstance(source, dict) and source.get("type") == "base64":
        data = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "text" and isinstance(source.get("data"), str):
        data = "data:text/plain;base64," + base64.b64encode(source["data"].encode()).decode()
    else:
        raise InvalidRequest(f"{at}.source: a document is sent as base64 or text (URLs are not fetched)",
                             param=f"{at}.source")  # fmt: skip
    return {"type": "file", "file": {"filename": name, "file_data": data}}


def _tool(tool: JSON, index: int) -> JSON:
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise InvalidRequest(
            f"tools.{index}.type: {kind!r} is a server tool, which this server does not run; only custom tools",
            param=f"tools.{index}.type",
        )
    unknown = set(tool) - CUSTOM_TOOL_FIELDS
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: tools.{index}.{min(unknown)}", param="tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: JSON) -> JSON:
    kind = choice.get("type")
    fields: JSON = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        return {**fields, "tool_choice": kind}
    if kind == "any":
        return {**fields, "tool_choice": "required"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise InvalidRequest('tool_choice: {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}',
                         param="tool_choice")  # fmt: skip
