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


async def summarise(
    store: UsageStore, key_id: str | None, since: float, until: float, currency: str = "USD"
) -> dict[str, Any]:
    """Requests and tokens, and spend where models have prices (`cost`, in `currency`: None when no row of
    the range had a price), in total, per model and (for all keys) per key."""
    rows = await store.usage_rows(key_id, since, until)
    by_model: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    by_key: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    by_outcome: collections.Counter[str] = collections.Counter()
    prompt = completion = 0
    spent: float | None = None
    for row in rows:
        p, c = int(row["prompt_tokens"]), int(row["completion_tokens"])  # type: ignore[call-overload]
        cost = float(row["cost"]) if row.get("cost") is not None else None  # type: ignore[arg-type]
        prompt, completion = prompt + p, completion + c
        groups = [by_model[str(row["model"])], *([by_key[str(row["key_id"])]] if key_id is None else [])]
        for group in groups:
            group["requests"] += 1
            group["prompt_tokens"] += p
            group["completion_tokens"] += c
            if cost is not None:
                group["cost"] += cost
        if cost is not None:
            spent = (spent or 0.0) + cost
        by_outcome[str(row["outcome"])] += 1
    return {
        "key": key_id,
        "since": datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds"),
        "until": datetime.fromtimestamp(until, UTC).isoformat(timespec="seconds"),
        "requests": len(rows),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cost": _money(spent),
        "currency": currency,
        "by_model": {name: _counts(counts) for name, counts in by_model.items()},
        "by_outcome": dict(by_outcome),
        **({"by_key": {key: _counts(counts) for key, counts in by_key.items()}} if key_id is None else {}),
    }


def _money(amount: float | None) -> float | None:
    return None if amount is None else round(amount, 6)


def _counts(counts: dict[str, float]) -> dict[str, Any]:
    """A group's requests and tokens as integers, its cost (when any row had one) to a millionth."""
    shown: dict[str, Any] = {name: int(value) for name, value in counts.items() if name != "cost"}
    if "cost" in counts:
        shown["cost"] = _money(counts["cost"])
    return shown


MAX_BUCKETS = 2000


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]


# The ledger's outcome of a request whose client went away before its answer ended.
CLIENT_CLOSED = "client_closed"


def status_of(outcome: object) -> str:
    """A ledger outcome as ok, error or cancelled (a request its client gave up on: a Stop, a closed tab,
    is no error of the server's). store.LedgerQuery filters by the same rule."""
    return "ok" if outcome == "ok" else "cancelled" if outcome == CLIENT_CLOSED else "error"


async def series(
    store: UsageStore, key_id: str | None, since: float, until: float, bucket: int, offset_minutes: int
) -> dict[str, Any]:
    """The ledger per time bucket and model: requests, errors, cancelled, tokens, cost (None where no row of
    the bucket was priced), latency p50/p95. Buckets of
    `bucket` seconds start at local midnight (or hour) for a clock `offset_minutes` ahead of UTC, so
    that a browser's days are its own."""
    if (until - since) / bucket > MAX_BUCKETS:
        raise InvalidRequest(f"At most {MAX_BUCKETS} buckets: widen the bucket or narrow the range.", param="bucket")
    shift = offset_minutes * 60
    grouped: dict[tuple[float, str], list[dict[str, object]]] = collections.defaultdict(list)
    for row in await store.usage_rows(key_id, since, until):
        moment = float(row["time"])  # type: ignore[arg-type]
        start = (moment + shift) // bucket * bucket - shift
        grouped[(start, str(row["model"]))].append(row)
    points = []
    for (start, model), rows in sorted(grouped.items()):
        latencies = [float(r["latency_ms"]) for r in rows]  # type: ignore[arg-type]
        costs = [float(r["cost"]) for r in rows if r.get("cost") is not None]  # type: ignore[arg-type]
        points.append(
            {
                "start": start,
                "model": model,
                "requests": len(rows),
                "errors": sum(1 for r in rows if status_of(r["outcome"]) == "error"),
                "cancelled": sum(1 for r in rows if status_of(r["outcome"]) == "cancelled"),
                "prompt_tokens": sum(int(r["prompt_tokens"]) for r in rows),  # type: ignore[call-overload]
                "completion_tokens": sum(int(r["completion_tokens"]) for r in rows),  # type: ignore[call-overload]
                "cost": sum(costs) if costs else None,
                "latency_p50_ms": round(_percentile(latencies, 0.5), 1),
                "latency_p95_ms": round(_percentile(latencies, 0.95), 1),
            }
        )
    return {"key": key_id, "since": since, "until": until, "bucket": bucket, "points": points}
