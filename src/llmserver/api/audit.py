"""The audit log (/api/audit, admin only): every admin action through the API, newest first."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request

from llmserver.api.access import Access, router
from llmserver.api.deps import audit, check_page
from llmserver.metrics.usage import parse_time
from llmserver.store import AuditQuery

admin = router(Access.ADMIN)
routers = (admin,)


@admin.get("/api/audit")
async def audit_log(
    request: Request,
    key: str | None = None,
    action: str | None = None,
    target: str | None = None,
    since: str | None = None,
    until: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    """The audit log's rows, newest first, `limit` at a time; the next page is asked for with `before`
    set to this page's `next_before`. Filters: `key` (an admin key's id), `action` (`keys.create`,
    `models.delete`, `nodes.drain`, …), `target` (a key id, a model's name, an instance or a node),
    `since`/`until` (Unix seconds or ISO-8601)."""
    check_page(limit, before)
    query = AuditQuery(
        key_id=key or None,
        action=action or None,
        target=target or None,
        since=parse_time(since, 0.0, "since"),
        until=parse_time(until, time.time() + 1, "until"),
        before=before,
        limit=limit + 1,  # one more: whether there is a next page
    )
    rows = await audit(request).page(query)
    page = [_shown(row) for row in rows[:limit]]
    more = len(rows) > limit
    return {"object": "list", "data": page, "has_more": more, "next_before": page[-1]["id"] if more else None}


def _shown(row: dict[str, object]) -> dict[str, Any]:
    change = row["change"]
    return {
        "id": row["id"],
        "time": row["time"],
        "key": {"id": row["key_id"], "name": row["key_name"]},
        "action": row["action"],
        "target": row["target"],
        "change": json.loads(change) if isinstance(change, str) else None,
        "status": row["status"],
        "client": row["client"],
        "request_id": row["request_id"],
    }
