"""OpenAI's Responses API request (`POST /v1/responses`), read as the chat request it amounts to.

A response is one chat completion: `instructions` and `input` become the messages, function tools
and `text.format` the chat's tools and response_format, `reasoning.effort` its reasoning_effort.
Everything after that is the chat path's: admission, quotas, the ledger, affinity, prompted or
native tools, images and files. Each field is honoured, accepted without effect, or refused with a
400 naming it, as for chat (docs/api/responses.md has the table). Nothing is stored: `store` is
accepted and nothing is kept, and a response cannot be retrieved or continued by id
(`previous_response_id` is refused by name): prompts and answers stay out of the database, as the
async jobs' privacy rules want, and a client sends its whole conversation each turn, as with chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from llmserver.errors import InvalidRequest
from llmserver.schemas.common import AsChat, AsChatRequest, Strict, absent, refused, string_field
from llmserver.schemas.openai import ReasoningEffort

JSON = dict[str, Any]

# A chat parameter → what the same thing is called in a Responses request (for the errors).
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class TextConfig(Strict):
    format: JSON | None = Field(default=None, description='{"type": "text" | "json_object" | "json_schema", …}')
    verbosity: Literal["medium"] | None = Field(default=None, description="Only medium (the default) is supported.")


class ReasoningConfig(Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="Accepted; the reasoning itself is returned, not a summary."
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # no effect


class ResponsesRequest(AsChatRequest):
    api_key: str | None = Field(default=None, description="The API key, when not sent as a Bearer token.")
    model: str | None = Field(default=None, description="Model name; default: the first configured model.")
    input: str | list[JSON] = Field(description="A text, or a list of input items (messages, function calls, …).")
    instructions: str | None = Field(default=None, description="A system message put first.")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, description="llama.cpp: sample from the k likeliest tokens.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-1, le=2**63 - 1)
    tools: list[JSON] | None = Field(
        default=None, max_length=128, description="Function tools, namespaces of them; web search is ignored."
    )
    tool_choice: str | JSON | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    keep_alive: float | None = Field(default=None, ge=0)
    user: str | None = Field(default=None, description="Used for prompt-cache affinity.")
    prompt_cache_key: str | None = Field(default=None, description="Used for prompt-cache affinity.")
    truncation: Literal["disabled"] | None = Field(default=None, description='Only "disabled" is supported.')
    # Accepted without effect.
    metadata: dict[str, str] | None = None
    store: bool | None = Field(default=None, description="Accepted; responses are never stored.")
    include: list[str] | None = Field(default=None, description="Accepted; nothing extra is included.")
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: JSON | None = Field(default=None, description="Accepted (Codex sends it with every request).")
    context_management: Any = Field(default=None, description="Accepted; a beta optimisation that changes no answer.")
    # Refused by name.
    previous_response_id: Any = refused("responses are not stored; send the whole conversation in input")
    conversation: Any = refused("conversations are not stored; send the whole conversation in input")
    background: Any = refused("background responses; use the async mode of /v1/chat/completions")
    prompt: Any = refused("stored prompt templates")
    top_logprobs: Any = refused("logprobs; use /v1/chat/completions")
    max_tool_calls: Any = refused("a tool-call budget")

    @field_validator(
        "previous_response_id", "conversation", "background", "prompt", "top_logprobs", "max_tool_calls"
    )  # fmt: skip
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return absent(cls, value, info)

    def chat(self) -> AsChat:
        """The chat request this response is."""
        chat_messages, origins = messages(self.instructions, self.input)
        body: JSON = {
            "model": self.model,
            "messages": chat_messages,
            "max_tokens": self.max_output_tokens,
            "stream": self.stream,
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "keep_alive": self.keep_alive,
            **{name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed")},
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        tools = [served for index, tool in enumerate(self.tools or []) for served in _tools(tool, index)]
        if tools:
            body["tools"] = tools
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _format(self.text.format)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return AsChat({name: value for name, value in body.items() if value is not None}, origins, PARAMS)


def messages(instructions: str | None, given: str | list[JSON]) -> tuple[list[JSON], list[str]]:
    """The chat messages of a Responses input: items in order, a run of function calls one assistant
    message, each function call output a tool message; and the parameter each came from."""
    out: list[JSON] = [{"role": "system", "content": instructions}] if instructions else []
    origins = ["instructions"] if instructions else []
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}], [*origins, "input"]
    if not given:
        raise InvalidRequest("input: must hold at least one item", param="input")
    reasoning: str | None = None  # an echoed reasoning item: given to the assistant turn after it
    for index, item in enumerate(given):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            name = string_field(item, "name", where)
            namespace = item.get("namespace")
            call = {
                "id": string_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": flat_name(namespace, name) if isinstance(namespace, str) and namespace else name,
                    "arguments": string_field(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
                continue
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(output, f"{where}.output", "user")
            if item.get("call_id") is None and isinstance(item.get("name"), str):
                # An output no call asked for (Codex's goal tool sends its objective so): a note in the
                # user's turn, naming the function it is from.
                namespace = item.get("namespace")
                name = flat_name(namespace, item["name"]) if isinstance(namespace, str) and namespace else item["name"]
                note = [{"type": "text", "text": f"Result of {name}:"}]
                out.append({"role": "user", "content": note + (_text_parts(content))})
            else:
                call_id = string_field(item, "call_id", where)
                out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            texts = [part.get("text") for part in item.get("content") or [] if isinstance(part, dict)]
            reasoning = "".join(text for text in texts if isinstance(text, str)) or None
            continue
        else:
            raise InvalidRequest(
                f"{where}.type: {kind!r} items are not supported (message, function_call, function_call_output "
                "and reasoning are)",
                param=f"{where}.type",
            )
        origins.append(where)
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = reasoning
        reasoning = None
    return out, origins


def _text_parts(content: str | list[JSON]) -> list[JSON]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


# A message item's fields: what a client writes, and what it copies back of one of our output items.
MESSAGE_FIELDS = {"type", "role", "content", "id", "status", "phase"}


def _message(item: JSON, where: str) -> JSON:
    unknown = set(item) - MESSAGE_FIELDS
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {where}.{min(unknown)}", param=f"{where}.{min(unknown)}"
        )
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"{where}.role: must be user, system, developer or assistant", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    return {"role": role, "content": _parts(content, f"{where}.content", role)}


def _parts(content: Any, where: str, role: str) -> list[JSON]:
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or a list of content parts", param=where)
    parts: list[JSON] = []
    for index, part in enumerate(content):
        at = f"{where}.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": string_field(part, "text", at)})
        elif kind == "refusal":
            parts.append({"type": "text", "text": string_field(part, "refusal", at)})
        elif kind == "input_image" and role != "assistant":
            if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
                raise InvalidRequest(f"{at}: an image is sent as image_url (a URL or data: URI)", param=at)
            image: JSON = {"url": part["image_url"]}
            if part.get("detail") in ("auto", "low", "high"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_file" and role != "assistant":
            if part.get("file_id") is not None or part.get("file_url") is not None:
                raise InvalidRequest(f"{at}: a file is sent inline as file_data (a data: URI)", param=at)
            file = {"filename": part.get("filename"), "file_data": part.get("file_data")}
            parts.append({"type": "file", "file": file})
        elif kind in ("file", "image_url") and role != "assistant":
            parts.append(part)  # our chat parts, as /v1/chat/completions takes them
        else:
            raise InvalidRequest(f"{at}.type: {kind!r} is not a content part taken here", param=f"{at}.type")
    return parts


# Hosted tools the model may be offered but that nothing here runs: ignored (the model answers
# without them), as an offer is no demand; a `tool_choice` that demands one is refused.
IGNORED_TOOLS = {"web_search", "web_search_preview"}
NAMESPACE_JOIN = "__"  # a namespace's function `name` in `ns` is served as `ns__name`


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_JOIN}{name}"


def namespaced(tools: list[JSON] | None) -> dict[str, tuple[str, str]]:
    """The served names of the functions inside namespace tools: their namespace and own name."""
    return {
        flat_name(tool["name"], inner["name"]): (tool["name"], inner["name"])
        for tool in tools or []
        if tool.get("type") == "namespace" and isinstance(tool.get("name"), str)
        for inner in tool.get("tools") or []
        if isinstance(inner, dict) and isinstance(inner.get("name"), str)
    }


def _tools(tool: JSON, index: int) -> list[JSON]:
    """The chat tools one Responses tool is: a function, a namespace's functions, or none."""
    kind = tool.get("type")
    if kind in IGNORED_TOOLS:
        return []
    if kind == "namespace":
        name = tool.get("name")
        inner = tool.get("tools")
        if not isinstance(name, str) or not name or not isinstance(inner, list):
            raise InvalidRequest(f"tools.{index}: a namespace has a name and tools", param=f"tools.{index}")
        served = []
        for at, function in enumerate(inner):
            where = f"tools.{index}.tools.{at}"
            if not isinstance(function, dict) or function.get("type") != "function":
                raise InvalidRequest(f"{where}.type: a namespace holds function tools here", param=f"{where}.type")
            flat = _tool(function, where)
            flat["function"]["name"] = flat_name(name, str(flat["function"].get("name")))
            served.append(flat)
        return served
    if kind != "function":
        raise InvalidRequest(
            f"tools.{index}.type: {kind!r} tools are not run here (function tools and namespaces of them are; "
            "web search is ignored): leave it out of the client's tools",
            param=f"tools.{index}.type",
        )
    return [_tool(tool, f"tools.{index}")]


def _tool(tool: JSON, where: str) -> JSON:
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading"}
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{min(unknown)}", param=where)
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | JSON) -> str | JSON:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":
        raise InvalidRequest("tool_choice: allowed_tools is not supported", param="tool_choice")
    if choice.get("type") in IGNORED_TOOLS:
        raise InvalidRequest(f"tool_choice: {choice['type']} is not run here", param="tool_choice")
    raise InvalidRequest('tool_choice: "none", "auto", "required" or {"type": "function", "name"}', param="tool_choice")


def _format(form: JSON) -> JSON:
    kind = form.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {key: form[key] for key in ("name", "description", "schema", "strict") if form.get(key) is not None}
        schema.setdefault("name", "answer")
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest("text.format.type: text, json_object or json_schema", param="text.format.type")
