"""The response shapes: llama-server's answers (and stream events) as our three wire formats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from llmserver.engine import translate
from llmserver.engine.tools import PromptedReader, ToolPlan

JSON = dict[str, Any]
DONE = b"data: [DONE]\n\n"
READING = b": reading the prompt\n\n"  # an SSE comment: clients skip it, and idle timers see bytes


def sse(event: JSON) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def named_sse(event: JSON) -> bytes:
    """An event named by its `type` (`event:` and `data:` lines), as the Responses and Messages APIs send them."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class Chunks:
    """A stream's chunks: its head (id, object, created, model) serialised once, each choice after it."""

    def __init__(self, head: JSON) -> None:
        self.opening = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['

    def __call__(self, piece: JSON) -> bytes:
        return self.opening + orjson.dumps(piece) + CLOSING

    def token(self, tokens: TokenEvents, text: bytes) -> bytes:
        return self.opening + tokens.before + text + tokens.after + CLOSING


CLOSING = b"]}\n\n"


@dataclass(frozen=True)
class TokenEvents:
    """Most events of a stream are one token of text and nothing else, always written alike by
    llama-server: such an event is relayed without being parsed, its text (a JSON string) cut out
    of it and put into our chunk as it is. Anything else (or anything unexpected) is parsed."""

    start: bytes  # llama-server's event up to the text
    end: bytes  # what follows the text in llama-server's event; it holds `,"`, which no JSON string does
    before: bytes  # our choice up to the text
    after: bytes  # and after it

    def text(self, data: bytes) -> bytes | None:
        """The token's text, as JSON, if `data` is such an event; None: parse it."""
        if not data.startswith(self.start):
            return None
        end = data.find(self.end, len(self.start))
        if end < 0:
            return None
        text = data[len(self.start) : end]
        # One JSON string: quoted, and no `,"` in it (inside a string every quote is escaped).
        if text[:1] != b'"' or text[-1:] != b'"' or len(text) < 2 or b',"' in text:
            return None
        tail = data[end:]
        if b'"prompt_progress"' in tail or b'"usage"' in tail:
            return None
        return text


CHAT_TOKEN = TokenEvents(
    start=b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":',
    end=b'}}],"',
    before=b'{"index":0,"delta":{"content":',
    after=b'},"finish_reason":null}',
)
COMPLETION_TOKEN = TokenEvents(
    start=b'{"choices":[{"text":',
    end=b',"index":0,"logprobs":null,"finish_reason":null}],"',
    before=b'{"text":',
    after=b',"index":0,"logprobs":null,"finish_reason":null}',
)


def choice(body: JSON) -> JSON:
    choices = body.get("choices") or [{}]
    first = choices[0]
    return first if isinstance(first, dict) else {}


def chat_text(body: JSON) -> str:
    return (choice(body).get("message") or {}).get("content") or ""


def completion_text(body: JSON) -> str:
    return str(choice(body).get("text", ""))


def unfenced(content: str) -> str:
    """A structured answer without the Markdown fence llama.cpp's grammar lets a model put around it."""
    stripped = content.strip()
    if stripped.startswith("```json") and stripped.endswith("```") and len(stripped) >= 10:
        return stripped[7:-3].strip()
    return content


def tool_call(call: JSON, index: int | None = None) -> JSON:
    """One tool call in OpenAI's shape (with its position, in a stream's deltas)."""
    function = call.get("function") or {}
    shaped: JSON = {} if index is None else {"index": index}
    if call.get("id"):
        shaped["id"] = call["id"]
        shaped["type"] = "function"
    parts = {key: function[key] for key in ("name", "arguments") if function.get(key) is not None}
    if parts:
        shaped["function"] = parts
    return shaped


def chat(body: JSON, model: str, plan: ToolPlan, usage: JSON, top_logprobs: int = 0) -> JSON:
    """The chat answer from llama-server's `body`; `usage`: its counts as `translate.usage` reads them."""
    first = choice(body)
    message = first.get("message") or {}
    reason = translate.finish_reason(first.get("finish_reason"))
    content: str | None = message.get("content") or ""
    calls: list[JSON] = [call for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    if plan.prompted:
        content, calls = plan.read(content or "", reason)
    elif plan.schema is not None and content:
        content = unfenced(content)
    answer: JSON = {"role": "assistant", "content": content if not calls else (content or None)}
    if message.get("reasoning_content"):
        answer["reasoning_content"] = message["reasoning_content"]
    if calls:
        answer["tool_calls"] = [tool_call(call) for call in calls]
        if reason != "length":  # calls cut by max_tokens: the complete ones, and still "length"
            reason = "tool_calls"
    shaped: JSON = {
        "index": 0,
        "message": answer,
        "logprobs": translate.chat_logprobs(first.get("logprobs"), top_logprobs),
        "finish_reason": reason,
    }
    if "__verbose" in body:  # asked for by a client that wants the stop sequence named (Anthropic's)
        shaped["stop_sequence"] = stopping_word(body)
    return {**translate.head("chatcmpl", "chat.completion", model), "choices": [shaped], "usage": usage}


def stopping_word(event: JSON) -> str | None:
    """The stop sequence that ended an answer, from llama.cpp's `__verbose`; None: something else did."""
    verbose = event.get("__verbose")
    word = verbose.get("stopping_word") if isinstance(verbose, dict) else None
    stop_type = verbose.get("stop_type") if isinstance(verbose, dict) else None
    return word if isinstance(word, str) and word and stop_type == "word" else None


def completion(body: JSON, model: str, logprobs: translate.LegacyLogprobs | None, usage: JSON) -> JSON:
    first = choice(body)
    return {
        **translate.head("cmpl", "text_completion", model),
        "choices": [
            {
                "text": completion_text(body),
                "index": 0,
                "logprobs": logprobs(first.get("logprobs")) if logprobs else None,
                "finish_reason": translate.finish_reason(first.get("finish_reason")),
            }
        ],
        "usage": usage,
    }


class Voice(Protocol):
    """How a stream speaks to its client. The relay (engine/generation.py) reads llama-server's events,
    and a StreamShape makes them typed pieces (our chat or completion choices); a voice writes those in
    one API's events: OpenAI's chunks (`OpenAIVoice`), or the Responses and Messages events
    (dialects/). It is called for every batch, in the callback of the connection the batch came in on."""

    def opening(self) -> bytes:
        """What goes first, once the prompt's counts are known (b"": nothing)."""
        ...

    def text(self, tokens: TokenEvents, raw: bytes) -> bytes:
        """One token of the answer's text, as the JSON string llama-server wrote (never parsed for chat)."""
        ...

    def pieces(self, pieces: list[JSON]) -> bytes:
        """Choices of our shape: deltas of text, reasoning or tool calls, a finish reason."""
        ...

    def reading(self) -> bytes:
        """A keepalive while the prompt is still being read."""
        ...

    def error(self, body: JSON) -> bytes:
        """The stream failed (`body`: our error envelope); `closing` follows."""
        ...

    def closing(self, usage: JSON | None) -> bytes:
        """The end, with the answer's usage in OpenAI's shape (after an error: what still follows it)."""
        ...


class OpenAIVoice:
    """OpenAI's chat or completion chunks: `data:` lines, usage last where asked for, then [DONE]."""

    def __init__(self, head: JSON, include_usage: bool) -> None:
        self.head = head
        self.chunks = Chunks(head)
        self.include_usage = include_usage
        self.failed = False

    def opening(self) -> bytes:
        return b""

    def text(self, tokens: TokenEvents, raw: bytes) -> bytes:
        return self.chunks.token(tokens, raw)

    def pieces(self, pieces: list[JSON]) -> bytes:
        chunk = self.chunks
        return chunk(pieces[0]) if len(pieces) == 1 else b"".join(map(chunk, pieces))

    def reading(self) -> bytes:
        return READING

    def error(self, body: JSON) -> bytes:
        self.failed = True
        return sse(body)

    def closing(self, usage: JSON | None) -> bytes:
        if self.include_usage and usage is not None and not self.failed:
            # Last, as OpenAI sends it (llama.cpp's completions carry it on their final choice).
            return sse({**self.head, "choices": [], "usage": usage}) + DONE
        return DONE


class StreamShape(Protocol):
    schema_param: str | None  # what to name when llama.cpp refuses the request's grammar
    tokens: TokenEvents | None  # its token events, when they may be relayed unparsed
    stopped: bool  # the answer is whole before llama-server ends it: the relay stops reading

    def pieces(self, event_choice: JSON) -> list[JSON]:
        """The choice objects (in our shape) for one of llama-server's stream events: none, one or more."""
        ...


class ChatStream:
    """A chat stream's choices. A prompted answer (`engine/tools.py`) is JSON the client must not see:
    it is read as it comes (`PromptedReader`), a direct answer's text sent as it is decoded, each call
    as a `delta.tool_calls` once whole."""

    def __init__(self, plan: ToolPlan, top_logprobs: int = 0) -> None:
        self.plan = plan
        self.top_logprobs = top_logprobs
        self.schema_param = plan.schema_param
        self.reader = PromptedReader(plan)
        self.held_logprobs: list[JSON] = []
        self.role_sent = False
        self.stopped = False
        # Text held back (prompted tool calls) is never relayed unparsed.
        self.tokens = None if plan.prompted else CHAT_TOKEN

    def pieces(self, event_choice: JSON) -> list[JSON]:
        delta = event_choice.get("delta") or {}
        reason = event_choice.get("finish_reason")
        logprobs = translate.chat_logprobs(event_choice.get("logprobs"), self.top_logprobs)
        out: JSON = {}
        if delta.get("role") and not self.role_sent:  # llama.cpp repeats it in its progress events
            out["role"] = delta["role"]
            self.role_sent = True
        if delta.get("reasoning_content"):
            out["reasoning_content"] = delta["reasoning_content"]
        if self.stopped:
            return []
        if self.plan.prompted:
            pieces = [_piece(out)] if out else []
            if delta.get("content"):
                text, completed = self.reader.feed(delta["content"])
                if text:
                    pieces.append(_piece({"content": text}))
                pieces += [_piece({"tool_calls": [tool_call(call, index)]}) for index, call in completed]
                if self.reader.repeated and not reason:
                    self.stopped, reason = True, "tool_calls"  # a call repeated: the answer ends before it
            if logprobs:
                self.held_logprobs.extend(logprobs["content"])
            return pieces + self._release(translate.finish_reason(reason)) if reason else pieces
        if delta.get("content") is not None:
            out["content"] = delta["content"]
        calls = [call for call in delta.get("tool_calls") or [] if isinstance(call, dict)]
        if calls:
            out["tool_calls"] = [tool_call(call, int(call.get("index", 0))) for call in calls]
        finish = translate.finish_reason(reason) if reason else None
        if not out and finish is None and logprobs is None:
            return []
        return [_piece(out, finish, logprobs)]

    def _release(self, reason: str) -> list[JSON]:
        """The end of a prompted answer: what is left of it, and the finish reason (its logprobs, of our
        JSON's tokens, come whole with it)."""
        text, calls, called = self.reader.end(reason)
        logprobs = {"content": self.held_logprobs, "refusal": None} if self.held_logprobs else None
        if called:
            finish = "length" if reason == "length" else "tool_calls"
            deltas = [_piece({"tool_calls": [tool_call(call, index)]}) for index, call in calls]
            return [*deltas, _piece({}, finish, logprobs)]
        return [_piece({"content": text}, None, logprobs), _piece({}, reason)]


def _piece(delta: JSON, finish: str | None = None, logprobs: JSON | None = None) -> JSON:
    shaped: JSON = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        shaped["logprobs"] = logprobs
    return shaped


class CompletionStream:
    def __init__(self, logprobs: translate.LegacyLogprobs | None) -> None:
        self.logprobs = logprobs
        self.stopped = False
        self.schema_param: str | None = None
        self.tokens = COMPLETION_TOKEN if logprobs is None else None

    def pieces(self, event_choice: JSON) -> list[JSON]:
        reason = event_choice.get("finish_reason")
        return [
            {
                "text": event_choice.get("text") or "",
                "index": 0,
                "logprobs": self.logprobs(event_choice.get("logprobs")) if self.logprobs else None,
                "finish_reason": translate.finish_reason(reason) if reason else None,
            }
        ]
