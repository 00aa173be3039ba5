"""The rest of a streamed answer that gave its slot back (the pool's fair shares bounded in time,
pool/pool.py): asked for again from where it stopped, so that its client sees a pause, not a cut.

The relay keeps the text it sent. When its call is stopped it waits for a slot again and asks for the
rest: a completion's prompt with the text so far after it; a chat's messages with the text so far as
the assistant's last message, which llama-server continues (its prefill of a last assistant message,
on unless a model's `llama_server_args` say `--no-prefill-assistant`) and whose text it sends again at
the start of the new stream: that much is cut here. max_tokens becomes what is left of it; the usage
the client gets counts the first prompt once and every generated token.

Only answers whose rest is exactly that are resumable: text alone — no tools (native or prompted), no
grammar, schema or response_format, no logprobs, one choice — and, for chat, no reasoning (thinking on
in the request, or reasoning text seen in the answer). Others keep their slot to their end.
"""

from __future__ import annotations

from typing import Any

import orjson

from llmserver.settings import ModelConfig

JSON = dict[str, Any]
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
# Request fields whose answer a continuation could not reproduce exactly.
NOT_RESUMABLE = (
    "tools", "grammar", "json_schema", "response_format", "logprobs", "top_logprobs", "n_probs", "echo", "suffix",
)  # fmt: skip


def resumable(path: str, payload: JSON, model: ModelConfig, raw_tokens: bool) -> bool:
    """Whether a stream of `payload` to `path` can be asked for again from where it stopped;
    `raw_tokens`: its token events are relayed as they are (a prompted tool plan's are not)."""
    if not raw_tokens or any(payload.get(name) for name in NOT_RESUMABLE) or payload.get("n", 1) != 1:
        return False
    if path == COMPLETION:
        return isinstance(payload.get("prompt"), str)
    if path != CHAT or not isinstance(payload.get("messages"), list):
        return False
    if (payload.get("chat_template_kwargs") or {}).get("enable_thinking"):
        return False
    return not any(arg.startswith("--no-prefill-assistant") for arg in model.llama_server_args)


def said(pieces: list[bytes | str]) -> str:
    """The text sent so far: token texts as llama-server wrote them (JSON strings) or parsed."""
    return "".join(orjson.loads(piece) if isinstance(piece, bytes) else piece for piece in pieces)


def rest(path: str, payload: JSON, text: str, generated: int) -> tuple[JSON, int] | None:
    """The payload that asks for the rest of an answer that has `text` so far, `generated` tokens, and
    how many characters of the new stream's text repeat `text` (cut by the relay); None when nothing is
    left to generate (max_tokens reached)."""
    left = int(payload.get("max_tokens") or 0) - generated
    if left < 1:
        return None
    if not text:  # nothing said yet: the same request
        return {**payload, "max_tokens": left}, 0
    if path == COMPLETION:
        return {**payload, "prompt": payload["prompt"] + text, "max_tokens": left}, 0
    messages = [*payload["messages"], {"role": "assistant", "content": text}]
    return {**payload, "messages": messages, "max_tokens": left}, len(text)
