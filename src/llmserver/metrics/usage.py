"""Summaries of the usage ledger (the CLI's `keys usage` and GET /api/usage)."""

from __future__ import annotations

import collections
import math
from datetime import UTC, datetime
from typing import Any

from llmserver.errors import InvalidRequest
from llmserver.store import UsageStore

LATEST = datetime(9999, 12, 31, tzinfo=UTC).timestamp()


def parse_time(value: str | None, default: float, param: str) -> float:
    """Unix seconds or ISO-8601 (UTC when no offset is given)."""
    if value is None or value == "":
        return default
    problem = InvalidRequest(f"{param} must be unix seconds or an ISO-8601 time (years 1970 to 9999).", param=param)
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise problem from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        seconds = moment.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds <= LATEST:
        raise problem
    return seconds


async def summarise(store: UsageStore, key_id: str | None, since: float, until: float) -> dict[str, Any]:
    rows = await store.usage_rows(key_id, since, until)
    by_model: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    by_outcome: collections.Counter[str] = collections.Counter()
    prompt = completion = 0
    for row in rows:
        p, c = int(row["prompt_tokens"]), int(row["completion_tokens"])  # type: ignore[call-overload]
        prompt, completion = prompt + p, completion + c
        model = by_model[str(row["model"])]
        model["requests"] += 1
        model["prompt_tokens"] += p
        model["completion_tokens"] += c
        by_outcome[str(row["outcome"])] += 1
    return {
        "key": key_id,
        "since": datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds"),
        "until": datetime.fromtimestamp(until, UTC).isoformat(timespec="seconds"),
        "requests": len(rows),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "by_model": {name: dict(counts) for name, counts in by_model.items()},
        "by_outcome": dict(by_outcome),
    }
