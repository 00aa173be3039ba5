"""Tool calling and structured outputs: what a chat request's `tools`, `tool_choice` and
`response_format` become in llama-server's payload, and what its answer becomes again.

Two ways, chosen per instance from its chat template (llama-server's /props):

- **native**: the template renders tools and tool calls itself (Qwen, Llama 3.x, Hermes, …).
  `tools`, `tool_choice` and the conversation's `tool_calls` / `tool` messages go to llama-server,
  which constrains and parses the calls; a named `tool_choice` becomes `required` over that one tool.
- **prompted**: the template knows no tools (SmolLM2's, say), and this llama.cpp build ignores
  tools then. The gateway describes the tools in the system message and constrains the answer
  with a JSON schema: `{"tool_calls": [{"name", "arguments"}]}` or `{"response": …}`; earlier
  calls and tool results are written into the conversation as that same JSON. The answer is parsed
  back into `message.tool_calls` (`finish_reason: "tool_calls"`) or plain content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from llmserver.engine.schemas import PATTERN_COST, Budget, check_schema
from llmserver.engine.translate import content_message, message_text
from llmserver.schemas.openai import (
    ChatMessage,
    ChatRequest,
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    NamedToolChoice,
    Tool,
)

JSON = dict[str, Any]

PROMPTED_INSTRUCTIONS = (
    "You can call the tools below (each with a JSON Schema of its arguments).\n{tools}\n\n"
    "Reply with one JSON object and nothing else: {forms}."
)
CALL_FORM = '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} to call tools'
ANSWER_FORM = '{"response": <your answer>} to answer the user directly'
PARALLEL_CALLS = 8  # the most calls one prompted answer holds


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def response_schema(request: ChatRequest) -> JSON | None:
    """The JSON schema the answer must match, from `response_format`; None for plain text.
    (`check_request` has checked it, before admission.)"""
    form = request.response_format
    if isinstance(form, JSONObjectFormat):
        return {"type": "object"}
    if isinstance(form, JSONSchemaResponseFormat):
        return form.json_schema.schema_ or {"type": "object"}
    return None


def check_request(request: ChatRequest, most: int = PATTERN_COST) -> None:
    """The schema checks of `response_format` and the tools' parameters, before admission (`most`: the
    largest pattern cost accepted)."""
    if request.response_format is None and not request.tools:
        return  # nothing to check (most requests)
    budget = Budget(most)  # every schema's grammar is built into the one request's: one budget
    check_schema(response_schema(request), "response_format", budget=budget)
    budget.unenforced_ok = True  # a tool's pattern llama.cpp cannot enforce is left unenforced (docs/api/openai.md)
    for index, tool in enumerate(request.tools or []):
        # Named by its place and its name: an agent sends dozens of tools.
        budget.label = f"tools.{index} ({tool.function.name})"
        check_schema(tool.function.parameters or {}, f"tools.{index}", budget=budget)


def added_prompt(request: ChatRequest) -> str:
    """Text as long as what tools add to the prompt (their description, in the template or in our
    instructions), for the quota bound."""
    if not request.tools:
        return ""
    tools = json.dumps([tool.model_dump(exclude_none=True) for tool in request.tools], ensure_ascii=False)
    return PROMPTED_INSTRUCTIONS + CALL_FORM + ANSWER_FORM + tools


@dataclass
class ToolPlan:
    """How one chat request's tools are served, and how its answer is read back."""

    native: bool
    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"  # auto, none or required; a named choice is required over one tool
    parallel: bool = True
    schema: JSON | None = None  # the response_format schema

    @classmethod
    def of(cls, request: ChatRequest, native: bool) -> ToolPlan:
        tools, choice = list(request.tools or []), request.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            tools = [tool for tool in tools if tool.function.name == choice.function.name]
            choice = "required"
        if choice == "none":
            tools = []
        parallel = request.parallel_tool_calls is not False
        return cls(native, tools, choice, parallel, response_schema(request))

    @property
    def prompted(self) -> bool:
        """The gateway describes the tools and reads the calls out of a JSON answer."""
        return not self.native and bool(self.tools)

    @property
    def schema_param(self) -> str | None:
        """The parameter a grammar of this request comes from, to name when llama.cpp refuses it."""
        if self.prompted:
            return "tools"
        return "response_format" if self.schema is not None else None

    def payload(self, messages: list[ChatMessage]) -> JSON:
        """The messages and the fields of llama-server's payload for tools and response_format."""
        fields: JSON = {}
        if self.native:
            fields["messages"] = [native_message(message) for message in messages]
            if self.tools:
                fields["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
                fields["tool_choice"] = self.choice
                fields["parallel_tool_calls"] = self.parallel
            if self.schema is not None:
                fields["response_format"] = json_schema_format(self.schema)
            return fields
        converted = prompted_history(messages, calls_as_json=self.prompted)
        if self.prompted:
            converted = _with_instructions(converted, self._instructions())
            fields["response_format"] = json_schema_format(self._answer_schema())
        elif self.schema is not None:
            fields["response_format"] = json_schema_format(self.schema)
        fields["messages"] = converted
        return fields

    def _instructions(self) -> str:
        described = [
            {"name": tool.function.name, "description": tool.function.description or "",
             "arguments": tool.function.parameters or {"type": "object"}}
            for tool in self.tools
        ]  # fmt: skip
        forms = CALL_FORM if self.choice == "required" else f"{CALL_FORM}, or {ANSWER_FORM}"
        return PROMPTED_INSTRUCTIONS.format(tools=json.dumps(described, ensure_ascii=False), forms=forms)

    def _answer_schema(self) -> JSON:
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": tool.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]
        }
        # A small model asked for calls may repeat one until max_tokens (measured on the embedded model
        # with tool_choice "required": the same call 30 times, the answer cut): the list is bounded, and
        # read up to its first repeated call.
        calls: JSON = {
            "type": "array",
            "items": call,
            "minItems": 1,
            "maxItems": PARALLEL_CALLS if self.parallel else 1,
        }
        with_calls = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if self.choice == "required":
            return with_calls
        answer = {
            "type": "object",
            "properties": {"response": self.schema or {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        return {"anyOf": [with_calls, answer]}

    def read(self, content: str, finish_reason: str) -> tuple[str | None, list[JSON]]:
        """A prompted answer's content and tool calls (in OpenAI's shape). The grammar admits nothing but
        our JSON, so an answer that does not parse was cut (by max_tokens): its complete calls are
        returned (perhaps none), or the part of its direct answer it holds; never our JSON itself."""
        if not self.prompted:
            return content, []
        try:
            answer = json.loads(content)
        except json.JSONDecodeError:
            return _cut(content)
        if isinstance(answer, dict) and isinstance(answer.get("tool_calls"), list):
            return None, _calls(until_repeated(answer["tool_calls"]))
        if isinstance(answer, dict) and "response" in answer:
            response = answer["response"]
            return (response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)), []
        return content, []


RESPONSE_TEXT = re.compile(r'\s*\{\s*"response"\s*:\s*"')
RESPONSE_OTHER = re.compile(r'\s*\{\s*"response"\s*:\s*[^\s"]')


class PromptedReader:
    """A prompted answer read as it comes (a stream): a direct answer's text as soon as it is decoded
    out of its JSON string, each call as soon as it is whole; a structured answer (the client's own
    JSON) at the end. The same answers as `ToolPlan.read` gives for the whole text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # the answer so far
        self.form: str | None = None  # "text", "calls" or "held", once its start says
        self.text_at = 0  # where the direct answer's text not yet decoded starts
        self.closed = False  # the direct answer's string has ended
        self.sent_calls = 0
        self.repeated = False  # a call repeated an earlier one: the answer is whole

    def feed(self, piece: str) -> tuple[str, list[tuple[int, JSON]]]:
        """The text and the calls (with their index) that `piece` completes."""
        self.text += piece
        if self.form is None:
            text = RESPONSE_TEXT.match(self.text)
            if text is not None:
                self.form, self.text_at = "text", text.end()
            elif CALLS_OPENING.match(self.text.lstrip()):
                self.form = "calls"
            elif RESPONSE_OTHER.match(self.text) or self.text.lstrip()[:1] not in ("", "{"):
                self.form = "held"
        if self.form == "text":
            return self._decoded(), []
        if self.form == "calls":
            return "", self._new_calls()
        return "", []

    def end(self, reason: str) -> tuple[str, list[tuple[int, JSON]], bool]:
        """What is left to send once the answer has ended: its text, its calls, and whether it called."""
        if self.form == "text":
            return self._decoded(), [], False
        if self.form == "calls":
            return "", self._new_calls(), self.sent_calls > 0
        content, read = self.plan.read(self.text, reason)
        return content or "", list(enumerate(read)), bool(read)

    def _decoded(self) -> str:
        if self.closed:
            return ""
        raw = self.text[self.text_at :]
        end, closed = _string_prefix(raw)
        try:
            text = json.loads('"' + raw[:end] + '"') if end else ""
        except json.JSONDecodeError:
            return ""
        self.text_at += end + closed
        self.closed = closed
        return str(text)

    def _new_calls(self) -> list[tuple[int, JSON]]:
        complete = complete_calls(self.text) or []
        kept = until_repeated(complete)
        self.repeated = len(kept) < len(complete)
        new = [(index, call) for index, call in enumerate(_calls(kept[self.sent_calls :]), self.sent_calls)]
        self.sent_calls = len(kept)
        return new


def _string_prefix(raw: str) -> tuple[int, bool]:
    """How much of a JSON string's inside (from after its opening quote) can be decoded as it stands:
    up to an escape still arriving; and whether its closing quote has come (just after that much)."""
    at = 0
    while at < len(raw):
        char = raw[at]
        if char == '"':
            return at, True
        if char != "\\":
            at += 1
            continue
        if at + 1 >= len(raw):
            break
        if raw[at + 1] != "u":
            at += 2
            continue
        if at + 6 > len(raw):
            break
        try:
            code = int(raw[at + 2 : at + 6], 16)
        except ValueError:
            break
        if 0xD800 <= code < 0xDC00:  # a high surrogate: decoded with the low one after it
            if at + 12 > len(raw):
                break
            at += 12
        else:
            at += 6
    return at, False


def until_repeated(calls: list[Any]) -> list[Any]:
    """The calls before the first that repeats an earlier one (same name and arguments): a model that
    repeats a call is looping, and no client wants the same call twice in one answer."""
    seen: set[str] = set()
    for at, call in enumerate(calls):
        same = json.dumps(call, sort_keys=True, ensure_ascii=False)
        if same in seen:
            return calls[:at]
        seen.add(same)
    return calls


def _calls(calls: list[Any]) -> list[JSON]:
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {
                "name": str(call.get("name", "")),
                "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
            },
        }
        for call in calls
        if isinstance(call, dict) and "name" in call and "arguments" in call
    ]


def _cut(content: str) -> tuple[str | None, list[JSON]]:
    """A prompted answer cut short: the calls it completed, or the start of its direct answer."""
    calls = complete_calls(content)
    if calls is not None:
        return None, _calls(until_repeated(calls))
    head = content.lstrip()
    key = head.find('"response"')
    if key < 0:
        return None, []
    value = head[_skip_space(head, head.find(":", key) + 1) :]
    if not value.startswith('"'):
        return value, []  # a structured answer's JSON, cut: the client's own schema, not ours
    for end in range(len(value), max(len(value) - 8, 0), -1):  # the cut may fall inside an escape
        try:
            text = json.loads(value[:end] + '"')
        except json.JSONDecodeError:
            continue
        return str(text), []
    return "", []


CALLS_OPENING = re.compile(r'\{\s*"tool_calls"\s*:\s*\[')


def complete_calls(content: str) -> list[Any] | None:
    """The complete call objects at the start of a prompted answer of calls (perhaps cut short); None
    for an answer that is not calls."""
    decoder = json.JSONDecoder()
    head = content.lstrip()
    opening = CALLS_OPENING.match(head)
    if opening is None:
        return None
    at = opening.end()
    calls: list[Any] = []
    while 0 < at < len(head):
        at = _skip_space(head, at)
        try:
            call, at = decoder.raw_decode(head, at)
        except json.JSONDecodeError:
            break
        calls.append(call)
        at = _skip_space(head, at)
        if head[at : at + 1] != ",":
            break
        at += 1
    return calls


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def json_schema_format(schema: JSON) -> JSON:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def native_message(message: ChatMessage) -> JSON:
    """A message as llama-server takes it when the template renders tools itself."""
    out = content_message(message)
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def prompted_history(messages: list[ChatMessage], calls_as_json: bool) -> list[JSON]:
    """The conversation for a template without tools. Each tool result becomes a user turn in words,
    naming its tool (measured on the embedded model: written as JSON, the answer after it copied that
    JSON back 11 times in 20). An assistant's calls become the JSON it would answer with when this turn
    is prompted for calls too (`calls_as_json`: the grammar holds the answer to that form), else words:
    an answer free of the grammar imitates any JSON it is shown."""
    names: dict[str, str] = {}
    result: list[JSON] = []
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            calls = []
            for call in message.tool_calls:
                names[call.id] = call.function.name
                calls.append({"name": call.function.name, "arguments": _arguments(call.function.arguments)})
            if calls_as_json:
                content = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            else:
                content = "\n".join(
                    f"(I called the tool {call['name']} with {json.dumps(call['arguments'], ensure_ascii=False)}.)"
                    for call in calls
                )
            if message.content:
                content = f"{message_text(message)}\n{content}"
            result.append({"role": "assistant", "content": content})
        elif message.role == "tool":
            assert message.tool_call_id is not None
            name = names.get(message.tool_call_id, "the tool")
            result.append({"role": "user", "content": f"Result of {name}: {message_text(message)}"})
        else:
            result.append(content_message(message))
    return result


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _with_instructions(messages: list[JSON], instructions: str) -> list[JSON]:
    """The instructions appended to the first system message, or as a new one in front."""
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]
