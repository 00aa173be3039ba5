"""The team admin API (/api/teams, admin only): teams, their limits and where their quota stands.

A key joins or leaves a team through the key API (`team_id` in POST or PATCH /api/keys).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from pydantic import Field

from llmserver.api.access import Access, body_of, router
from llmserver.api.deps import keys, quota, teams, validate
from llmserver.api.keys import Limits, checked_limits
from llmserver.auth.keys import limit_fields
from llmserver.auth.teams import MAX_NAME
from llmserver.errors import FieldProblem, NotFound
from llmserver.store import KeyRecord, TeamRecord

admin = router(Access.ADMIN)
routers = (admin,)


class TeamBody(Limits):
    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)


class CreateTeam(TeamBody):
    name: str = Field(min_length=1, max_length=MAX_NAME)


async def _described(request: Request, team: TeamRecord, members: list[KeyRecord]) -> dict[str, Any]:
    return {
        "id": team.id,
        "name": team.name,
        "created_at": team.created_at,
        **limit_fields(team.limits),
        "keys": [{"id": k.id, "name": k.name} for k in members if k.team_id == team.id and k.active],
        "quota": await quota(request).standing(team.id, team.limits),
        "spend": await quota(request).budget_standing(team.id, team.limits),
    }


@admin.get("/api/teams")
async def list_teams(request: Request) -> dict[str, Any]:
    """Every team: its limits, its active keys and where its quota stands."""
    found, members = await asyncio.gather(teams(request).list(), keys(request).list())
    return {"object": "list", "data": [await _described(request, team, members) for team in found]}


@admin.post("/api/teams", status_code=201)
async def create_team(request: Request) -> dict[str, Any]:
    body = validate(CreateTeam, body_of(request))
    limits = checked_limits(request, body.limits(), body.models is not None)
    try:
        team = await teams(request).create(body.name, limits)
    except FieldProblem as exc:
        raise exc.refusal() from None
    return await _described(request, team, [])


@admin.get("/api/teams/{team_id}")
async def get_team(request: Request, team_id: str) -> dict[str, Any]:
    team = await teams(request).get(team_id)
    if team is None:
        raise NotFound(f"No team with id {team_id!r}.", param="team_id")
    return await _described(request, team, await keys(request).list())


@admin.patch("/api/teams/{team_id}")
async def update_team(request: Request, team_id: str) -> dict[str, Any]:
    """Change the name and the limits the body names (null clears a limit); the others stay as they are."""
    body = validate(TeamBody, body_of(request))
    current = await teams(request).get(team_id)
    if current is None:
        raise NotFound(f"No team with id {team_id!r}.", param="team_id")
    limits = body.patched(request, current.limits)
    try:
        team = await teams(request).update(team_id, body.name or current.name, limits)
    except FieldProblem as exc:
        raise exc.refusal() from None
    if team is None:
        raise NotFound(f"No team with id {team_id!r}.", param="team_id")
    return await _described(request, team, await keys(request).list())


@admin.delete("/api/teams/{team_id}")
async def delete_team(request: Request, team_id: str) -> dict[str, Any]:
    """Delete a team without active keys (409 while it has some: move them out or revoke them first)."""
    if not await teams(request).delete(team_id):
        raise NotFound(f"No team with id {team_id!r}.", param="team_id")
    return {"id": team_id, "deleted": True}
