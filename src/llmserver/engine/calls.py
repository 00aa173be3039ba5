"""The instance call: a request sent to llama-server on its ticket's slot, under the one retry policy.

A request is sent at most `instance_attempts` times (2 by default), and again only when the instance
could not be reached or dropped the connection before answering; for a stream, only before its
first event, when nothing has reached the client. llama-server may close a kept-alive connection
just as the next request is written on it (measured: 40% of requests sent within 1 ms of a
stream's end), so the second attempt is common and quiet. Before it, the instance is reported to
its pool (the supervisor takes a dead one out of service) and a fresh slot is taken, perhaps on
another instance. Each attempt is bounded by `request_timeout`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from llmserver import tracing
from llmserver.errors import ContextLengthExceeded, GatewayTimeout, InstanceUnavailable, UpstreamError
from llmserver.llama import wire
from llmserver.llama.client import LlamaServerClient, Sink
from llmserver.pool.admission import Admission, Ticket
from llmserver.pool.instance import Instance

log = logging.getLogger(__name__)

JSON = dict[str, Any]
PROMPT_PARAM = {
    "/v1/chat/completions": "messages", "/v1/embeddings": "input", "/v1/responses": "input", "/v1/messages": "messages",
}  # fmt: skip


class InstanceCalls:
    def __init__(self, admission: Admission, *, attempts: int, timeout: float, isolate_keys: bool = True) -> None:
        self._admission = admission
        self.attempts = attempts
        self.timeout = timeout
        self.isolate_keys = isolate_keys  # cache_isolation = "key"

    async def _isolated(self, ticket: Ticket, path: str, payload: JSON) -> JSON:
        """The payload, pinned to a slot whose cached prompt it may reuse only if that prompt is its own
        key's (cache_isolation = "key"): no key learns from `cached_tokens`, or from how fast its prompt
        was read, whether another key sent the same start. A node's instance, which other gateways also
        use, keeps its slots' owners in a record they all share (cluster/slots.py). A conversation that
        the slot does not hold but that was saved (when its slot was taken by another, or its instance
        stopped) is restored into the slot first (pool/router.py, pool/saved_prompts.py)."""
        if not self.isolate_keys or path == "/v1/embeddings":
            return payload
        pinned = await ticket.lease.pin(*_prompt_identity(payload))
        if pinned is None:
            return {**payload, "cache_prompt": False}
        slot, reuse = pinned
        return {**payload, "id_slot": slot, "cache_prompt": reuse}

    async def call(self, ticket: Ticket, path: str, payload: JSON) -> JSON:
        """One non-streamed call's JSON answer."""
        for attempt in range(1, self.attempts + 1):
            pid = _pid(ticket)
            try:
                sent = await self._isolated(ticket, path, payload)
                if _carries_grammar(sent):
                    ticket.lease.carries_grammar()
                client = _client(ticket)
                if tracing.on():
                    with tracing.span("instance call", _call_attributes(ticket, attempt)) as span:
                        answer = await client.post_json(path, sent, fresh=attempt > 1, timeout=self.timeout)
                        _first_token_event(span, answer)
                else:  # without the no-op span's calls
                    answer = await client.post_json(path, sent, fresh=attempt > 1, timeout=self.timeout)
                ticket.lease.answered()
                return answer
            except ContextLengthExceeded as exc:
                _name_prompt(exc, ticket)
                raise
            except InstanceUnavailable:
                await self._after_failure(ticket, attempt, pid)
        raise AssertionError("unreachable")

    async def open_stream(
        self, ticket: Ticket, path: str, payload: JSON, stopper: wire.Stopper | None = None
    ) -> tuple[list[bytes], AsyncGenerator[list[bytes], Sink | None]]:
        """A streamed call's first events' data, and the rest of them, in the batches they arrived in
        (the caller closes them); the whole stream is bounded by the timeout. `stopper` may end it early
        (wire.Preempted, from here or from the rest of the events)."""
        for attempt in range(1, self.attempts + 1):
            # A generator that raised is finished: nothing to close but on success.
            span = tracing.start("instance call", _call_attributes(ticket, attempt)) if tracing.on() else None
            pid = _pid(ticket)
            try:
                sent = await self._isolated(ticket, path, payload)
                if _carries_grammar(sent):
                    ticket.lease.carries_grammar()
                events = _client(ticket).stream(path, sent, fresh=attempt > 1, timeout=self.timeout, stopper=stopper)
                first = await anext(events)
                ticket.lease.answered()
                if span is not None:
                    span.add_event("first token")
                    ticket.tally.span = span  # ended with the request (metrics/recorder.py, close)
                return first, events
            except ContextLengthExceeded as exc:
                tracing.end(span, exc)
                _name_prompt(exc, ticket)
                raise
            except StopAsyncIteration:
                tracing.end(span, UpstreamError("closed"))
                raise UpstreamError("The instance closed the stream without sending anything.") from None
            except InstanceUnavailable as exc:
                tracing.end(span, exc)
                await self._after_failure(ticket, attempt, pid)
            except BaseException as exc:
                tracing.end(span, exc)
                raise
        raise AssertionError("unreachable")

    async def _after_failure(self, ticket: Ticket, attempt: int, pid: int | None) -> None:
        """Report the instance to its pool and give its slot back; then raise on the last attempt, or
        take a fresh slot for the next one. Not sent again when the watchdog restarted its instance's
        process `pid` under it (here or on its node)."""
        instance = ticket.lease.instance
        stalled = await stalled_error(ticket, pid)
        if stalled is not None:
            ticket.lease.failed()
            raise stalled  # sent again, it would hold the next instance the same way
        if instance is not None and instance.shared and await instance.stall_reason(pid) is not None:
            # Its node restarted the process for another key's grammar: this request is sent again once the
            # restarted one answers (the registry would still route it to the process that is starting).
            await _answering(instance, RESTART_WAIT)
        died = instance is not None and instance.exited
        again = attempt < self.attempts
        log.log(
            logging.WARNING if died or not again else logging.DEBUG,
            "instance %s %s under a request (attempt %d of %d)%s",
            ticket.tally.instance_id, "died" if died else "dropped the connection", attempt, self.attempts,
            "; sending it again" if again else "",
        )  # fmt: skip
        ticket.lease.failed()
        if not again:
            raise InstanceUnavailable("The model instance could not be reached or closed the connection.")
        await self._admission.take_slot(ticket)


async def stalled_error(ticket: Ticket, pid: int | None = None) -> GatewayTimeout | None:
    """The error for a request whose instance's process (`pid`: the one it was sent to; by default the
    instance's) the watchdog restarted, here or on its node: its main loop made no progress."""
    instance = ticket.lease.instance
    if instance is None:
        return None
    reason = await instance.stall_reason(pid if pid is not None else instance.pid, ticket.tally.principal.key_id)
    if reason is None:
        return None
    return GatewayTimeout(
        f"The model's instance {reason}, so it was restarted and this request ended. A JSON schema whose "
        "pattern nests repetitions, or a very long prompt on a slow machine, can cause this."
    )


RESTART_WAIT = 60.0  # seconds a request dropped by another key's stall waits for the restarted process


async def _answering(instance: Instance, within: float) -> None:
    """Wait (at most `within` seconds) until the instance answers its health probe, or its record is gone (the
    registry replaced it with the restarted process's: the request's next slot is taken on that one)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        client = instance.client
        if client is None or not instance.accepting or await client.healthy(1.0):
            return
        await asyncio.sleep(0.25)


def _carries_grammar(payload: JSON) -> bool:
    """Whether llama-server builds a grammar for the call: a JSON schema, a grammar, a response format other
    than text, or tools (a tool call is constrained by one)."""
    if "json_schema" in payload or "grammar" in payload or "tools" in payload:
        return True
    form = payload.get("response_format")
    return isinstance(form, dict) and form.get("type", "text") != "text"


def _pid(ticket: Ticket) -> int | None:
    """The process of the instance a call goes to (a node restarts its instance under a new one)."""
    instance = ticket.lease.instance
    return instance.pid if instance is not None else None


def _prompt_identity(payload: JSON) -> tuple[int, int]:
    """Which of a key's conversations the prompt is — a hash of how it begins (its first two messages, or
    its first 4,096 characters) — and its length in bytes (its messages as JSON: at least its tokens, the
    template's aside)."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return _stable_hash(orjson.dumps(messages[:2])), len(orjson.dumps(messages))
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        return 0, 0
    return _stable_hash(prompt[:4096].encode("utf-8", "surrogatepass")), len(prompt.encode("utf-8", "surrogatepass"))


def _stable_hash(data: bytes) -> int:
    """The same in every process (a saved conversation is found again after a restart), never 0."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") or 1


def _name_prompt(exc: ContextLengthExceeded, ticket: Ticket) -> None:
    """A prompt over the context names the parameter the client sent it as."""
    exc.param = PROMPT_PARAM.get(ticket.tally.endpoint, "prompt")


def _client(ticket: Ticket) -> LlamaServerClient:
    client = ticket.lease.client
    if client is None:
        raise InstanceUnavailable("The instance went away.")
    return client


def _call_attributes(ticket: Ticket, attempt: int) -> dict[str, str | int]:
    return {"model": ticket.lease.pool.name, "instance": ticket.tally.instance_id or "", "attempt": attempt}


def _first_token_event(span: Any, answer: JSON) -> None:
    """A non-streamed answer's first token, at the time llama-server measured (its prompt's processing)."""
    timings = answer.get("timings") if isinstance(answer, dict) else None
    prompt_ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
    if isinstance(prompt_ms, int | float):
        span.add_event("first token", {"prompt_ms": float(prompt_ms)})
