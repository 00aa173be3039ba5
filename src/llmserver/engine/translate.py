"""Translation between our wire formats and llama-server's.

Only fields we validated are ever sent to llama-server: requests are rebuilt, never passed through.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from llmserver.schemas.common import Sampling, normalize_stop
from llmserver.schemas.openai import ChatMessage, ChatRequest, ContentPart, FilePart, ImagePart, ImageURL, TextPart

JSON = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def head(prefix: str, object_: str, model: str) -> JSON:
    """The fields every OpenAI response object (or stream chunk) starts with."""
    return {"id": new_id(prefix), "object": object_, "created": int(time.time()), "model": model}


def sampling_payload(request: Sampling, max_tokens: int, stop: list[str] | None) -> JSON:
    payload: JSON = {"max_tokens": max_tokens, **request.sampling_fields()}
    stops = normalize_stop(stop)
    if stops:
        payload["stop"] = stops
    return payload


def chat_messages(messages: list[ChatMessage]) -> list[JSON]:
    """Messages in the form llama-server's chat template takes: text parts joined into one string;
    a message with images keeps its parts in order, each image already one we decoded and re-encoded."""
    result: list[JSON] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        content = message.content
        if isinstance(content, list):
            # File parts were replaced by their text, and image URLs by our own data URIs, before this.
            assert not any(isinstance(part, FilePart) for part in content), "a file part reached the payload"
            if any(isinstance(part, ImagePart) for part in content):
                result.append({"role": role, "content": [_part(part) for part in content]})
                continue
            content = "\n".join(part.text for part in content if isinstance(part, TextPart))
        result.append({"role": role, "content": content or ""})
    return result


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


def chat_payload(request: ChatRequest, max_tokens: int, *, stream: bool) -> JSON:
    payload = sampling_payload(request, max_tokens, request.stop)
    payload["messages"] = chat_messages(request.messages)
    payload["stream"] = stream
    if stream:
        # Always asked for, so the gateway knows the real counts; forwarded only when the client asked.
        payload["stream_options"] = {"include_usage": True}
    return payload


def finish_reason(value: Any) -> str:
    """OpenAI's finish_reason: `length` when max_tokens (or the context) cut the answer, else `stop`."""
    return "length" if value == "length" else "stop"


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
