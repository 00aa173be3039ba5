"""Who may act on which key: one rule, decided on the key itself, for every route and command that names one.

Roles form a lattice: admin > team admin > key. Each actor has a scope: an admin's is the whole server,
a team admin's its own team, a plain key's only itself.

- An actor **sees** a key (lists it, reads its usage) when the key lies inside its scope and its role is
  at most the actor's. Any other key is, to that actor, a key that does not exist (404): a team admin
  learns nothing of other teams' keys, nor of a key above it.
- An actor **manages** a key (reads its secret, rotates, changes, revokes or moves it) only when the
  key — as it is, and as the change would leave it — lies inside its scope with a role strictly below the
  actor's. A key it sees but may not manage (a fellow team admin, itself) is a 403 naming why.
- The admin is the lattice's top, and nothing is above it: an admin manages every key, admin keys
  included (otherwise a lost or leaked admin key could be ended only at the command line).

**Admin keys belong to no team.** A team is a team admin's scope: an admin key inside one would lie in
reach of a role below its own (issue 82: a team admin rotated an admin key of its team and took its new
secret), and a team's limits around a key that may change them would be no limit at all. Creating an
admin key in a team, or moving one into a team, is refused (`team_id`); a row of that shape left from
before is still an admin key, out of every team admin's sight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from llmserver.auth.keys import Principal
from llmserver.errors import NotFound, PermissionDenied
from llmserver.store import KeyRecord


class Role(enum.IntEnum):
    KEY = 0
    TEAM_ADMIN = 1
    ADMIN = 2


@dataclass(frozen=True)
class Standing:
    """A key's place in the lattice: its role and the team it is in (None: none)."""

    role: Role
    team_id: str | None
    key_id: str | None = None  # a key that exists (a plain key's scope is itself)

    @classmethod
    def of(cls, *, admin: bool, team_admin: bool, team_id: str | None, key_id: str | None = None) -> Standing:
        if admin:
            return cls(Role.ADMIN, team_id, key_id)
        return cls(Role.TEAM_ADMIN if team_admin and team_id is not None else Role.KEY, team_id, key_id)


def standing_of_key(record: KeyRecord) -> Standing:
    return Standing.of(admin=record.is_admin, team_admin=record.team_admin, team_id=record.team_id, key_id=record.id)


def standing_of_actor(actor: Principal) -> Standing:
    team_id = actor.team.id if actor.team is not None else None
    return Standing.of(admin=actor.is_admin, team_admin=actor.team_admin, team_id=team_id, key_id=actor.key_id)


def _in_scope(actor: Standing, target: Standing) -> bool:
    if actor.role is Role.ADMIN:
        return True
    if actor.role is Role.TEAM_ADMIN:
        return target.team_id == actor.team_id
    return target.key_id is not None and target.key_id == actor.key_id


def sees(actor: Principal, target: KeyRecord) -> bool:
    """Whether the actor may know the key exists: list it, read its usage."""
    me, it = standing_of_actor(actor), standing_of_key(target)
    return _in_scope(me, it) and it.role <= me.role


def _manages(me: Standing, it: Standing) -> bool:
    return _in_scope(me, it) and (it.role < me.role or me.role is Role.ADMIN)


def authorize(actor: Principal, before: KeyRecord | None, after: Standing) -> None:
    """Raise unless `actor` may turn the key `before` (None: a key to be made) into one of standing `after`:
    NotFound for a key the actor does not see (as one that does not exist), PermissionDenied, naming the
    field at fault, for one it sees but may not manage or may not make into `after`."""
    me = standing_of_actor(actor)
    if before is not None:
        if not sees(actor, before):
            raise NotFound(f"No key with id {before.id!r}.", param="key_id")
        if not _manages(me, standing_of_key(before)):
            whose = "its own key" if before.id == actor.key_id else "a key whose powers are not below its own"
            raise PermissionDenied(f"This key cannot manage {whose}.", param="key_id")
    if not _manages(me, after):
        if after.role is Role.ADMIN:
            raise PermissionDenied("Only an admin key can make admin keys.", param="admin")
        if after.role >= me.role:
            raise PermissionDenied("A team admin key cannot make admin or team admin keys.", param="team_admin")
        raise PermissionDenied(
            f"A team admin key manages the keys of its own team ({me.team_id!r}) only.", param="team_id"
        )
