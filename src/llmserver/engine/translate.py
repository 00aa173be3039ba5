"""Translation between our wire formats and llama-server's.

Only fields we validated are ever sent to llama-server: requests are rebuilt, never passed through.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from llmserver.errors import InvalidRequest
from llmserver.schemas.common import Sampling, normalize_stop
from llmserver.schemas.openai import ChatMessage, ChatRequest, ImagePart, TextPart

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


def chat_messages(messages: list[ChatMessage], model_name: str) -> list[JSON]:
    """Messages with their content as plain text, in the form llama-server's chat template takes."""
    result: list[JSON] = []
    for index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        content = message.content
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if isinstance(part, TextPart):
                    texts.append(part.text)
                elif isinstance(part, ImagePart):
                    raise InvalidRequest(
                        f"The model {model_name!r} is not vision-capable: it does not accept image parts.",
                        param=f"messages.{index}.content",
                    )
                else:  # file parts were replaced by their text before this point
                    raise AssertionError("a file part reached the payload")
            content = "\n".join(texts)
        result.append({"role": role, "content": content or ""})
    return result


def native_messages(prompt: str, system: str | None) -> list[JSON]:
    messages: list[JSON] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


def chat_payload(request: ChatRequest, max_tokens: int, model_name: str, *, stream: bool) -> JSON:
    payload = sampling_payload(request, max_tokens, request.stop)
    payload["messages"] = chat_messages(request.messages, model_name)
    payload["stream"] = stream
    if stream:
        # Always asked for, so the gateway knows the real counts; forwarded only when the client asked.
        payload["stream_options"] = {"include_usage": True}
    return payload


def finish_reason(value: Any) -> str:
    """OpenAI's finish_reason: `length` when max_tokens (or the context) cut the answer, else `stop`."""
    return "length" if value == "length" else "stop"


def usage(body: JSON) -> JSON:
    counts = body.get("usage") or {}
    prompt = int(counts.get("prompt_tokens", 0))
    completion = int(counts.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
