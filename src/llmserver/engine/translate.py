"""Translation between our wire formats and llama-server's.

Only fields we validated are ever sent to llama-server: requests are rebuilt, never passed through.
"""

from __future__ import annotations

import random
import time
from typing import Any

from llmserver.schemas.common import Sampling, normalize_stop
from llmserver.schemas.openai import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ContentPart,
    FilePart,
    ImagePart,
    ImageURL,
    TextPart,
)

JSON = dict[str, Any]


def new_id(prefix: str, separator: str = "-") -> str:
    """`prefix-` and 24 random hex digits, as OpenAI's ids: from Python's generator (seeded from the
    system, and again in a forked child), not a system call each (os.urandom costs several µs on a
    busy VM, once per answer). Names, not secrets; and not a counter, which would tell any caller how
    many requests the gateway has served."""
    return f"{prefix}{separator}{random.getrandbits(96):024x}"


def head(prefix: str, object_: str, model: str) -> JSON:
    """The fields every OpenAI response object (or stream chunk) starts with."""
    return {"id": new_id(prefix), "object": object_, "created": int(time.time()), "model": model}


def sampling_payload(request: Sampling, max_tokens: int, stop: list[str] | None) -> JSON:
    payload: JSON = {"max_tokens": max_tokens, **request.sampling_fields()}
    stops = normalize_stop(stop)
    if stops:
        payload["stop"] = stops
    bias = getattr(request, "logit_bias", None)
    if bias:
        payload["logit_bias"] = bias
    return payload


def stream_fields(stream: bool) -> JSON:
    if not stream:
        return {"stream": False}
    # Always asked for, so the gateway knows the real counts; forwarded only when the client asked.
    return {"stream": True, "stream_options": {"include_usage": True}}


def chat_messages(messages: list[ChatMessage]) -> list[JSON]:
    return [content_message(message) for message in messages]


def message_text(message: ChatMessage) -> str:
    """A message's text: its text parts joined, as the chat template sees them."""
    if isinstance(message.content, list):
        return "\n".join(part.text for part in message.content if isinstance(part, TextPart))
    return message.content or ""


def content_message(message: ChatMessage) -> JSON:
    """A message's role and content as llama-server's chat template takes them: text parts joined
    into one string; a message with images keeps its parts in order, each image already one we
    decoded and re-encoded."""
    role = "system" if message.role == "developer" else message.role
    content = message.content
    out: JSON = {"role": role, "content": message_text(message)}
    if isinstance(content, list):
        # File parts were replaced by their text, and image URLs by our own data URIs, before this.
        assert not any(isinstance(part, FilePart) for part in content), "a file part reached the payload"
        if any(isinstance(part, ImagePart) for part in content):
            out["content"] = [_part(part) for part in content]
    if message.reasoning_content and role == "assistant":
        out["reasoning_content"] = message.reasoning_content  # a thinking template may show it again
    return out


def _part(part: TextPart | ImagePart | FilePart) -> JSON:
    if isinstance(part, ImagePart):
        return {"type": "image_url", "image_url": {"url": part.image_url.url}}
    assert isinstance(part, TextPart)
    return {"type": "text", "text": part.text}


def native_messages(system: str | None, prompt: str, images: list[str], files: list[FilePart]) -> list[ChatMessage]:
    """The native request as chat messages: an optional system turn, then one user turn with the
    files (whose text goes first), the prompt and the images, in that order."""
    messages: list[ChatMessage] = []
    if system is not None:
        messages.append(ChatMessage(role="system", content=system))
    content: str | list[ContentPart] = prompt
    if images or files:
        content = [
            *files,
            TextPart(type="text", text=prompt),
            *(ImagePart(type="image_url", image_url=ImageURL(url=url)) for url in images),
        ]
    messages.append(ChatMessage(role="user", content=content))
    return messages


def chat_payload(request: ChatRequest, max_tokens: int, fields: JSON) -> JSON:
    """llama-server's chat payload; `fields`: the messages and the tool and response_format fields
    (`engine/tools.py`)."""
    payload = {**sampling_payload(request, max_tokens, request.stop), **fields, **stream_fields(request.stream)}
    if request.logprobs:
        payload["logprobs"] = True
        # llama.cpp reports logprobs only with at least one alternative; extra ones are cut again.
        payload["top_logprobs"] = max(request.top_logprobs or 0, 1)
    return payload


def completion_payload(request: CompletionRequest, max_tokens: int, prompt: str) -> JSON:
    payload = {**sampling_payload(request, max_tokens, request.stop), "prompt": prompt}
    payload.update(stream_fields(request.stream))
    if request.logprobs is not None:
        # llama.cpp reports logprobs only with at least one alternative; extra ones are cut again.
        payload["logprobs"] = max(request.logprobs, 1)
    return payload


def finish_reason(value: Any) -> str:
    """OpenAI's finish_reason: `length` when max_tokens (or the context) cut the answer, `tool_calls`
    when it calls tools, else `stop`."""
    return value if value in ("length", "tool_calls") else "stop"


def chat_logprobs(raw: Any, top: int) -> JSON | None:
    """llama-server's logprobs in OpenAI's chat shape (without llama.cpp's token ids), with the
    `top` likeliest alternatives at each step."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list):
        return None
    return {"content": [_logprob(entry, top) for entry in content], "refusal": None}


def _logprob(entry: JSON, top: int | None = None) -> JSON:
    out: JSON = {"token": entry.get("token", ""), "logprob": entry.get("logprob"), "bytes": entry.get("bytes")}
    if top is not None:
        out["top_logprobs"] = [_logprob(other) for other in (entry.get("top_logprobs") or [])[:top]]
    return out


class LegacyLogprobs:
    """llama-server's logprobs in the legacy completions shape: tokens, token_logprobs, top_logprobs
    (the `n` likeliest, token → logprob) and text_offset (characters from the prompt's start),
    carried across the events of a stream."""

    def __init__(self, n: int, prompt: str) -> None:
        self.n = n
        self.offset = len(prompt)

    def __call__(self, raw: Any) -> JSON | None:
        content = raw.get("content") if isinstance(raw, dict) else None
        if not isinstance(content, list):
            return None
        shaped: JSON = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in content:
            token = str(entry.get("token", ""))
            shaped["tokens"].append(token)
            shaped["token_logprobs"].append(entry.get("logprob"))
            alternatives = (entry.get("top_logprobs") or [])[: self.n]
            shaped["top_logprobs"].append({str(other.get("token", "")): other.get("logprob") for other in alternatives})
            shaped["text_offset"].append(self.offset)
            self.offset += len(token)
        return shaped


def usage(body: JSON) -> JSON:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` (prompt tokens the instance took
    from its cache) when llama-server reported it."""
    counts = body.get("usage") or {}
    prompt = int(counts.get("prompt_tokens", 0))
    completion = int(counts.get("completion_tokens", 0))
    result: JSON = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        result["prompt_tokens_details"] = {"cached_tokens": cached}
    return result


def cached_tokens(usage: JSON) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
