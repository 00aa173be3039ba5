"""One log format for every line a process writes, ours and uvicorn's, and the request id they carry.

`configure(level, "text")`: `TIME LEVEL LOGGER: message`, and ` [request ID]` on a line written while
a request was being answered. `configure(level, "json")`: one JSON object per line with `time` (ISO
8601, UTC), `level`, `logger`, `message`, `request_id` when there is one, the fields a record carries
in `extra` (the access log's: method, path, status, duration_ms, key, model, instance, tokens), and
`exception` (its traceback) when one was logged.

The request id is the client's `X-Request-Id` when it sent a usable one (up to 128 characters of
letters, digits and `-_.:/+=`), else one made here; `server/front.Front` sets it for the request's task
and every task it starts (a context variable), returns it on the answer and sends it to the instance.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import random
import re
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, TypeVar

T = TypeVar("T")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

USABLE_ID = re.compile(r"^[A-Za-z0-9\-_.:/+=]{1,128}$")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a LogRecord has of its own: anything else on a record came in `extra`.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message"  # uvicorn's message with terminal colours: the plain one is enough
}  # fmt: skip


def background(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task for the process's own work (a write batch, a probe) started while a request is answered:
    with a fresh context, so that its log lines carry no request's id (and no trace's span)."""
    return asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())


def new_request_id(sent: str | None) -> str:
    """The client's id when it is usable, else a fresh one (16 hex digits)."""
    if sent is not None and USABLE_ID.match(sent):
        return sent
    # A correlation id, not a secret: Python's generator, not a system call per request.
    return f"{_ids.getrandbits(64):016x}"


_ids = random.Random()


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request {rid}]" if rid and "\n" not in line else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS and value is not None and not name.startswith("_"):
                entry[name] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """The root logger writes to stderr in `fmt`; uvicorn's loggers go through it (no handlers of
    their own), so that every line has one format and a time."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestId())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
