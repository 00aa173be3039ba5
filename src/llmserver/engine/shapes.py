"""The response shapes: llama-server's answers (and stream events) as our three wire formats."""

from __future__ import annotations

import json
from typing import Any

from llmserver.engine import translate

JSON = dict[str, Any]
DONE = b"data: [DONE]\n\n"


def sse(event: JSON) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def choice(body: JSON) -> JSON:
    choices = body.get("choices") or [{}]
    first = choices[0]
    return first if isinstance(first, dict) else {}


def chat_text(body: JSON) -> str:
    return (choice(body).get("message") or {}).get("content") or ""


def completion_text(body: JSON) -> str:
    return str(choice(body).get("text", ""))


def chat(body: JSON, model: str) -> JSON:
    return {
        **translate.head("chatcmpl", "chat.completion", model),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": chat_text(body)},
                "finish_reason": translate.finish_reason(choice(body).get("finish_reason")),
            }
        ],
        "usage": translate.usage(body),
    }


def completion(body: JSON, model: str) -> JSON:
    return {
        **translate.head("cmpl", "text_completion", model),
        "choices": [
            {
                "text": completion_text(body),
                "index": 0,
                "logprobs": None,
                "finish_reason": translate.finish_reason(choice(body).get("finish_reason")),
            }
        ],
        "usage": translate.usage(body),
    }


def chat_chunk(event_choice: JSON) -> JSON:
    delta = event_choice.get("delta") or {}
    out: JSON = {}
    if delta.get("role"):
        out["role"] = delta["role"]
    if delta.get("content") is not None:
        out["content"] = delta["content"]
    reason = event_choice.get("finish_reason")
    return {"index": 0, "delta": out, "finish_reason": translate.finish_reason(reason) if reason else None}


def completion_chunk(event_choice: JSON) -> JSON:
    reason = event_choice.get("finish_reason")
    return {
        "text": event_choice.get("text") or "",
        "index": 0,
        "logprobs": None,
        "finish_reason": translate.finish_reason(reason) if reason else None,
    }
