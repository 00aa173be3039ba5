"""Teams: keys that share limits.

A team carries the limits a key can (a token quota per period, requests per minute, requests in flight,
a model allow-list); a member key's requests must fit both its own limits and its team's, counted for
all the team's keys together on every gateway (pool/admission.py, auth/quota.py). A key is in one team
at most. A team is deleted only once no active key is a member (move or revoke them first): its limits
never silently stop applying to keys that still run.
"""

from __future__ import annotations

import secrets

from llmserver.auth.keys import KeyService, check_limits
from llmserver.errors import Conflict, FieldProblem
from llmserver.store import KeyLimits, TeamRecord, TeamStore

MAX_NAME = 200


class TeamNameTaken(Conflict):
    pass


class TeamHasMembers(Conflict):
    pass


def check_name(name: str) -> str:
    name = name.strip()
    if not name or len(name) > MAX_NAME:
        raise FieldProblem(f"a team needs a name of 1 to {MAX_NAME} characters", "name")
    return name


class TeamService:
    def __init__(self, store: TeamStore, keys: KeyService) -> None:
        self._store = store
        self._keys = keys  # what it remembers of its members is forgotten when a team's limits change

    async def create(self, name: str, limits: KeyLimits) -> TeamRecord:
        name = check_name(name)
        team = await self._store.insert_team("team_" + secrets.token_hex(6), name, check_limits(limits))
        if team is None:
            raise TeamNameTaken(f"A team named {name!r} already exists.", param="name")
        return team

    async def get(self, team_id: str) -> TeamRecord | None:
        return await self._store.team_by_id(team_id)

    async def list(self) -> list[TeamRecord]:
        return await self._store.list_teams()

    async def update(self, team_id: str, name: str, limits: KeyLimits) -> TeamRecord | None:
        """The team with its new name and limits; None for an unknown team."""
        name = check_name(name)
        changed = await self._store.update_team(team_id, name, check_limits(limits))
        if changed is True:
            raise TeamNameTaken(f"A team named {name!r} already exists.", param="name")
        self._keys.forget()  # at once on this gateway; elsewhere within state.key_cache_seconds
        return changed or None

    async def delete(self, team_id: str) -> bool:
        """False for an unknown team; TeamHasMembers while active keys are in it."""
        members = await self._store.delete_team(team_id)
        if members is None:
            return False
        if members:
            raise TeamHasMembers(
                f"The team {team_id!r} has {members} active {'key' if members == 1 else 'keys'}: move "
                f"{'it' if members == 1 else 'them'} out of the team (team_id null) or revoke "
                f"{'it' if members == 1 else 'them'} first.",
                param="team_id",
            )
        self._keys.forget()
        return True
