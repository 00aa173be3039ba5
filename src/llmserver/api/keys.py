"""The key admin API (/api/keys: admin keys, and team admin keys for their own team's keys), the caller's
own key (/api/me), usage summaries (/api/usage, /api/usage/series) and the request log
(/api/usage/requests).

Which key an actor may see or manage is decided on the key, by one rule (`auth/authority.py`): a team
admin key sees its team's keys up to its own role (any other key is a 404, as one that does not exist)
and manages only those strictly below it (its members), makes keys only in its team with limits within the
team's, and can neither make admin or team admin keys nor move a key out of its team; an admin key
manages every key, and belongs to no team."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from llmserver.api.access import Access, body_of, caller, router
from llmserver.api.deps import check_page, keys, lineup, quota, recorder, settings, store, teams, validate
from llmserver.auth.authority import Standing, authorize, sees, standing_of_key
from llmserver.auth.keys import (
    DEFAULT_GRACE,
    Principal,
    check_admin_team,
    check_limits,
    describe,
    limit_fields,
    may_use,
    unmatched,
)
from llmserver.errors import FieldProblem, InvalidRequest, NotFound, PermissionDenied
from llmserver.metrics.usage import parse_time, series, status_of, summarise
from llmserver.store import STATUSES, KeyLimits, KeyRecord, LedgerQuery, TeamRecord

keyed = router(Access.KEY)
managing = router(Access.TEAM)
routers = (keyed, managing)


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quota_tokens: int | None = Field(default=None, ge=1)
    quota_period: str | None = Field(default=None, pattern="^(day|month|total)$")
    rpm: int | None = Field(default=None, ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)
    models: list[str] | None = Field(default=None, description="Model names or patterns the key may use; null: all.")
    budget: float | None = Field(default=None, gt=0, description="What its requests may cost per budget_period.")
    budget_period: str | None = Field(default=None, pattern="^(day|month|total)$")

    def limits(self) -> KeyLimits:
        models = tuple(self.models) if self.models is not None else None
        return KeyLimits(
            self.quota_tokens,
            self.quota_period,
            self.rpm,
            self.max_concurrency,
            models,
            self.budget,
            self.budget_period,
        )

    def patched(self, request: Request, current: KeyLimits) -> KeyLimits:
        """`current` with the limits this PATCH body names (null clears one) and the others kept, checked."""
        given = self.limits()
        named = self.model_fields_set & set(Limits.model_fields)
        changed = replace(current, **{name: getattr(given, name) for name in named})
        return checked_limits(request, changed, "models" in named)


class Expiry(Limits):
    expires_at: float | str | None = Field(
        default=None, description="When the key stops being accepted: Unix seconds or ISO-8601; null: never."
    )
    team_id: str | None = Field(
        default=None, max_length=64, description="The team whose limits apply around the key's own; null: none."
    )
    team_admin: bool = Field(default=False, description="The key manages its team's keys (admin keys only).")

    def expiry(self) -> float | None:
        return None if self.expires_at is None else parse_time(str(self.expires_at), 0.0, "expires_at")


class CreateKey(Expiry):
    name: str = Field(min_length=1, max_length=200)
    admin: bool = False


def _managed_team(request: Request) -> TeamRecord | None:
    """The team a team admin key manages (its keys are all it may see or change); None for an admin key."""
    principal = caller(request)
    return None if principal.is_admin else principal.team


async def _found(request: Request, key_id: str) -> KeyRecord:
    record = await keys(request).get(key_id)
    if record is None:
        raise NotFound(f"No key with id {key_id!r}.", param="key_id")
    return record


async def _managed(request: Request, key_id: str) -> KeyRecord:
    """The key, if the caller may manage it as it is (`authority.authorize`): a 404 for a key it does not
    see, as one that does not exist; a 403 for one it sees but is not above."""
    record = await _found(request, key_id)
    authorize(caller(request), record, standing_of_key(record))
    return record


def _within_team(team: TeamRecord, limits: KeyLimits) -> None:
    """What a team admin may not give a key: more than its team has."""
    for name in ("quota_tokens", "rpm", "max_concurrency", "budget"):
        mine, theirs = getattr(limits, name), getattr(team.limits, name)
        if mine is not None and theirs is not None and mine > theirs:
            raise InvalidRequest(f"{name}: at most the team's {theirs}", param=name)
    if limits.models is not None and team.limits.models is not None:
        outside = [m for m in limits.models if not may_use(team.limits, m)]
        if outside:
            raise InvalidRequest(f"models: {', '.join(map(repr, outside))} not among the team's models", param="models")


@managing.get("/api/keys")
async def list_keys(request: Request) -> dict[str, Any]:
    """Every key (a team admin: its team's), and where each with a quota stands in its current window."""
    principal = caller(request)
    records = [k for k in await keys(request).list() if sees(principal, k)]
    quotas = quota(request)
    active = [k for k in records if k.revoked_at is None]
    standing = iter(await asyncio.gather(*(quotas.standing(k.id, k.limits) for k in active)))
    spent = iter(await asyncio.gather(*(quotas.budget_standing(k.id, k.limits) for k in active)))
    return {
        "object": "list",
        "data": [
            {**describe(k), "quota": next(standing) if k.revoked_at is None else None,
             "spend": next(spent) if k.revoked_at is None else None}
            for k in records
        ],
    }  # fmt: skip


@managing.post("/api/keys", status_code=201, response_model=None)
async def create_key(request: Request) -> JSONResponse:
    body = validate(CreateKey, body_of(request))
    limits = checked_limits(request, body.limits(), body.models is not None)
    team = _managed_team(request)
    team_id = body.team_id if "team_id" in body.model_fields_set or team is None else team.id
    authorize(caller(request), None, Standing.of(admin=body.admin, team_admin=body.team_admin, team_id=team_id))
    _admin_outside_teams(body.admin, team_id)
    if team is not None:
        _within_team(team, limits)
    elif team_id is not None:
        await _team(request, team_id)
    elif body.team_admin:
        raise InvalidRequest("team_admin: a team admin key needs a team_id", param="team_admin")
    try:
        record, key = await keys(request).create(
            body.name, admin=body.admin, limits=limits, expires_at=body.expiry(), team_id=team_id,
            team_admin=body.team_admin,
        )  # fmt: skip
    except FieldProblem as exc:
        raise exc.refusal() from None
    # The secret, shown once: no cache along the way may keep a copy.
    return JSONResponse({**describe(record), "key": key}, status_code=201, headers={"Cache-Control": "no-store"})


@managing.patch("/api/keys/{key_id}")
async def update_key(request: Request, key_id: str) -> dict[str, Any]:
    """Change the limits, the expiry and the team the body names (null clears one); the others stay as they
    are."""
    body = validate(Expiry, body_of(request))
    current = await _found(request, key_id)
    team_id = body.team_id if "team_id" in body.model_fields_set else current.team_id
    team_admin = body.team_admin if "team_admin" in body.model_fields_set else current.team_admin
    after = Standing.of(admin=current.is_admin, team_admin=team_admin, team_id=team_id, key_id=key_id)
    authorize(caller(request), current, after)  # before anything about the body: a key it does not see is a 404
    limits = body.patched(request, current.limits)
    if "team_id" in body.model_fields_set:
        _admin_outside_teams(current.is_admin, team_id)
    if (team := _managed_team(request)) is not None:
        _within_team(team, limits)
    elif "team_id" in body.model_fields_set and body.team_id is not None:
        await _team(request, body.team_id)
    found = await keys(request).update(key_id, limits)
    if found and "expires_at" in body.model_fields_set:
        try:
            await keys(request).set_expiry(key_id, body.expiry())
        except FieldProblem as exc:
            raise exc.refusal() from None
    if team_admin and team_id is None:
        raise InvalidRequest("team_admin: a team admin key needs a team_id", param="team_admin")
    moved = found and (team_id, team_admin and team_id is not None) != (current.team_id, current.team_admin)
    if moved and not await keys(request).set_team(key_id, team_id, team_admin):
        if team_id is not None and await teams(request).get(team_id) is None:
            raise InvalidRequest(f"team_id: no team with id {team_id!r}", param="team_id")
        raise NotFound(f"No active key with id {key_id!r}.", param="key_id")
    record = await keys(request).get(key_id) if found else None
    if record is None:
        raise NotFound(f"No key with id {key_id!r}.", param="key_id")
    return describe(record)


def _admin_outside_teams(admin: bool, team_id: str | None) -> None:
    try:
        check_admin_team(admin, team_id)
    except FieldProblem as exc:
        raise exc.refusal() from None


async def _team(request: Request, team_id: str) -> None:
    """400 unless the team exists (a key sent to a team that does not would have no team's limits)."""
    if await teams(request).get(team_id) is None:
        raise InvalidRequest(f"team_id: no team with id {team_id!r}", param="team_id")


KNOWN_NAMED = 20  # the models a refused allow-list's message names at most


def checked_limits(request: Request, limits: KeyLimits, models_given: bool) -> KeyLimits:
    """Limits that make sense together, with (when given) an allow-list whose every entry names or matches a
    model this server serves or lists in its catalog: a typo would otherwise make a key that every request
    refuses, and nobody would know why. An empty list is kept: a key allowed no model (for later)."""
    try:
        check_limits(limits)
    except FieldProblem as exc:
        raise exc.refusal() from None
    if not models_given or not limits.models:
        return limits
    names = sorted(model.name for model in lineup(request))
    missing = unmatched(limits.models, names)
    if missing:
        known = ", ".join(names[:KNOWN_NAMED]) + (", …" if len(names) > KNOWN_NAMED else "") if names else "none"
        which = ", ".join(repr(m) for m in missing)
        raise InvalidRequest(
            f"models: {which} {'matches' if len(missing) == 1 else 'match'} no model this server serves or lists"
            f" in its catalog (its models: {known})",
            param="models",
        )
    return limits


@managing.post("/api/keys/{key_id}/rotate", response_model=None)
async def rotate_key(request: Request, key_id: str, grace_seconds: float = DEFAULT_GRACE) -> JSONResponse:
    """A new secret for the key (in the answer, once); the old one is still accepted for `grace_seconds`
    (default 3600, at most 30 days; 0: not at all), so that its users can switch without an outage."""
    await _managed(request, key_id)
    try:
        rotated = await keys(request).rotate(key_id, grace_seconds)
    except FieldProblem as exc:
        raise exc.refusal() from None
    if rotated is None:
        raise NotFound(f"No active key with id {key_id!r}.", param="key_id")
    record, key = rotated
    return JSONResponse({**describe(record), "key": key}, headers={"Cache-Control": "no-store"})


@managing.delete("/api/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> dict[str, Any]:
    await _managed(request, key_id)
    if not await keys(request).revoke(key_id):
        raise NotFound(f"No active key with id {key_id!r}.", param="key_id")
    record = await keys(request).get(key_id)
    assert record is not None
    return describe(record)


@keyed.get("/api/usage")
async def usage(
    request: Request, key: str | None = None, since: str | None = None, until: str | None = None
) -> dict[str, Any]:
    """Usage of one key (default: the caller's own); admins may ask for any key, or all with key=*."""
    wanted = await _usage_of(request, key)
    start = parse_time(since, 0.0, "since")
    end = parse_time(until, time.time() + 1, "until")
    await recorder(request).flush()  # rows of requests that just finished
    return await summarise(store(request), wanted, start, end, settings(request).billing.currency)


async def _usage_of(request: Request, key: str | None) -> str | None:
    """The key whose usage is asked for (None: all keys), if the caller may read it: its own, any for an
    admin key, one it sees (`authority.sees`) for a team admin key."""
    principal = caller(request)
    wanted = key or principal.key_id
    if wanted == principal.key_id or principal.is_admin:
        return None if wanted == "*" else wanted
    if principal.team_admin and wanted != "*":
        record = await keys(request).get(wanted)
        if record is not None and sees(principal, record):
            return wanted
    raise PermissionDenied("Only admin keys may read another key's usage (team admin keys: their team's).")


@keyed.get("/api/me")
async def me(request: Request) -> dict[str, Any]:
    """The calling key: its id, name, whether it is an admin key, and its limits (what the console shows)."""
    principal = caller(request)
    config = settings(request)
    return {
        "id": principal.key_id,
        "name": principal.name,
        "fingerprint": principal.fingerprint,
        "admin": principal.is_admin,
        "team_admin": principal.team_admin,
        **limit_fields(principal.limits),
        "quota": await quota(request).standing(principal.key_id, principal.limits),
        "spend": await quota(request).budget_standing(principal.key_id, principal.limits),
        "team": await _own_team(request, principal),
        # The server's request limits, for clients that check inputs before sending them (the names they had
        # before the settings were put in sections: clients read them).
        "server": {
            "max_tokens_limit": config.limits.max_tokens,
            "max_images": config.limits.images.max_images,
            "max_image_bytes": config.limits.images.max_bytes,
            "max_files": config.limits.files.max_files,
            "max_file_bytes": config.limits.files.max_bytes,
            "currency": config.billing.currency,  # of prices, costs and budgets
        },
    }


async def _own_team(request: Request, principal: Principal) -> dict[str, Any] | None:
    """The caller's team, its limits and where its quota stands (what applies around the key's own)."""
    team = principal.team
    if team is None:
        return None
    return {
        "id": team.id,
        "name": team.name,
        **limit_fields(team.limits),
        "quota": await quota(request).standing(team.id, team.limits),
        "spend": await quota(request).budget_standing(team.id, team.limits),
    }


BUCKETS = {"hour": 3600, "day": 86400}


@keyed.get("/api/usage/series")
async def usage_series(
    request: Request,
    key: str | None = None,
    since: str | None = None,
    until: str | None = None,
    bucket: str = "day",
    offset_minutes: int = 0,
) -> dict[str, Any]:
    """Usage per bucket ("hour" or "day", starting at the caller's local midnight when given its
    clock's `offset_minutes` ahead of UTC) and model; the same rules for `key` as /api/usage."""
    wanted = await _usage_of(request, key)
    if bucket not in BUCKETS:
        raise InvalidRequest("bucket must be 'hour' or 'day'.", param="bucket")
    if not -14 * 60 <= offset_minutes <= 14 * 60:
        raise InvalidRequest("offset_minutes must be between -840 and 840.", param="offset_minutes")
    end = parse_time(until, time.time() + 1, "until")
    start = parse_time(since, end - 30 * 86400, "since")
    await recorder(request).flush()
    return await series(store(request), wanted, start, end, BUCKETS[bucket], offset_minutes)


@keyed.get("/api/usage/requests")
async def usage_requests(
    request: Request,
    key: str | None = None,
    model: str | None = None,
    status: str | None = None,
    since: str | None = None,
    until: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    """The request log: the ledger's rows, newest first, `limit` at a time; the next page is asked for
    with `before` set to this page's `next_before`. Filters: `model`, `status` (ok, error: the server's
    or the request's fault, cancelled: its client went away), `since`/`until`; the same rules for `key`
    as /api/usage."""
    wanted = await _usage_of(request, key)
    check_page(limit, before)
    if status is not None and status not in STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(STATUSES)}.", param="status")
    query = LedgerQuery(
        key_id=wanted,
        model=model or None,
        status=status,
        since=parse_time(since, 0.0, "since"),
        until=parse_time(until, time.time() + 1, "until"),
        before=before,
        limit=limit + 1,  # one more: whether there is a next page
    )
    await recorder(request).flush()
    rows = await store(request).usage_page(query)
    page = [_logged(row) for row in rows[:limit]]
    more = len(rows) > limit
    return {"object": "list", "data": page, "has_more": more, "next_before": page[-1]["id"] if more else None}


def _logged(row: dict[str, object]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "time": row["time"],
        "key": row["key_id"],
        "model": row["model"],
        "endpoint": row["endpoint"],
        "instance_id": row["instance_id"],
        "status": status_of(row["outcome"]),
        "outcome": row["outcome"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "latency_ms": row["latency_ms"],
        "ttft_ms": row["ttft_ms"],
        "tokens_per_second": row["tokens_per_second"],
        "cost": row.get("cost"),
    }
