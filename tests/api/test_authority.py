"""Authorization on objects (issue 82's first row): every route that names a key, from the route table, called
on the real server by every kind of actor on every kind of key, against the lattice written out here on its
own (admin > team admin > key; a team admin's scope is its team; a plain key's, itself).

Before the rule, a team admin rotated a fellow team admin (and an admin key put in its team) and took the
new secret: the matrix below fails on that code.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from llmserver.api.access import Access, access_of, app_routes
from llmserver.app import create_app
from llmserver.auth.keys import KeyService, fingerprint, generate_key, hash_key
from llmserver.settings import Settings
from llmserver.store import NO_LIMITS, open_store
from tests.support import Server, assert_error, database_url

ACTORS = ("admin", "team_admin_a", "team_admin_b", "member_a", "plain")
TARGETS = (
    "admin",
    "admin_in_team_a",  # a row of the shape the API no longer makes (written straight to the store)
    "team_admin_a",
    "team_admin_b",
    "member_a",
    "member_b",
    "plain",
    "revoked_member_a",
    "expired_member_a",
    "self",
)


@dataclass(frozen=True)
class Key:
    id: str
    secret: str
    role: str  # admin, team_admin, key
    team: str | None  # "a", "b" or None
    revoked: bool = False
    expired: bool = False


def _role_and_team(kind: str) -> tuple[str, str | None]:
    role = "admin" if kind.startswith("admin") else "team_admin" if kind.startswith("team_admin") else "key"
    team = "a" if kind.endswith("_a") else "b" if kind.endswith("_b") else None
    return role, team


RANK = {"key": 0, "team_admin": 1, "admin": 2}


def sees(actor: Key, target: Key) -> bool:
    """The lattice, written apart from the server's code."""
    if actor.role == "admin":
        return True
    if actor.role == "team_admin":
        return target.team == actor.team and RANK[target.role] <= RANK["team_admin"]
    return target.id == actor.id


def manages(actor: Key, target: Key) -> bool:
    if actor.role == "admin":
        return True
    return actor.role == "team_admin" and target.team == actor.team and RANK[target.role] < RANK["team_admin"]


def _world(data_dir: Path, tag: str) -> tuple[dict[str, str], dict[str, Key], dict[str, Key]]:
    """Two teams, one actor of each kind, and one target of each kind per actor (fresh, as the matrix revokes
    and rotates them): (team ids, actors, targets by (actor, kind) joined as 'actor/kind')."""

    async def make() -> tuple[dict[str, str], dict[str, Key], dict[str, Key]]:
        store = await open_store(database_url(data_dir))
        try:
            service = KeyService(store)
            teams = {}
            for name in ("a", "b"):
                team = await store.insert_team(f"team_{tag}_{name}", f"matrix {tag} {name}", NO_LIMITS)
                assert team is not None
                teams[name] = team.id

            async def key(kind: str, label: str) -> Key:
                role, team = _role_and_team(kind.removeprefix("revoked_").removeprefix("expired_"))
                team_id = teams[team] if team else None
                if role == "admin" and team_id is not None:  # the legacy shape: straight into the store
                    secret = generate_key()
                    record = await store.insert_key(
                        f"key_{label}", label, hash_key(secret), fingerprint(hash_key(secret)), True, team_id=team_id
                    )
                else:
                    record, secret = await service.create(
                        label, admin=role == "admin", team_id=team_id, team_admin=role == "team_admin"
                    )
                revoked, expired = kind.startswith("revoked_"), kind.startswith("expired_")
                if revoked:
                    assert await store.revoke_key(record.id)
                if expired:
                    assert await store.set_key_expiry(record.id, time.time() - 60)
                return Key(record.id, secret, role, team, revoked, expired)

            actors = {kind: await key(kind, f"{tag}-{kind}") for kind in ACTORS}
            targets = {}
            for actor in ACTORS:
                for kind in TARGETS:
                    if kind != "self":
                        targets[f"{actor}/{kind}"] = await key(kind, f"{tag}-{actor}-{kind}")
            return teams, actors, targets
        finally:
            await store.close()

    return asyncio.run(make())


@dataclass(frozen=True)
class Call:
    method: str
    path: str  # with {key_id} to fill, or a `key` query parameter
    body: dict[str, object] | None
    manage: bool  # manages the key (changes it or reads its secret); else reads about it
    access: Access  # who may call the route at all (its router)


def _key_routes(tmp_path: Path) -> list[Call]:
    """Every route of the app that names a key: by a {key_id} path parameter or a `key` query parameter."""
    app = create_app(Settings(data_dir=tmp_path))
    calls = []
    for route in app_routes(app.routes):
        if not isinstance(route, APIRoute) or access_of(route) is Access.PUBLIC:
            continue
        named = "{key_id}" in route.path_format
        queried = "key" in inspect.signature(route.endpoint).parameters
        if not (named or queried):
            continue
        access = access_of(route)
        assert access is not None
        for method in sorted(route.methods or ()):
            path = route.path_format if named else route.path_format + "?key={key_id}"
            if method == "PATCH":
                calls.append(Call(method, path, {"rpm": 7}, True, access))
                calls.append(Call(method, path, {"team_id": "{team_b}"}, True, access))
            elif method == "POST":
                calls.append(Call(method, path + "?grace_seconds=0", None, True, access))
            else:
                calls.append(Call(method, path, None, method != "GET", access))
    return calls


@pytest.fixture(scope="module")
def key_routes(tmp_path_factory: pytest.TempPathFactory) -> list[Call]:
    return _key_routes(tmp_path_factory.mktemp("routes"))


def test_the_routes_that_name_a_key_are_all_here(key_routes: list[Call]) -> None:
    found = {(c.method, re.sub(r"\?.*", "", c.path)) for c in key_routes}
    assert {
        ("PATCH", "/api/keys/{key_id}"),
        ("DELETE", "/api/keys/{key_id}"),
        ("POST", "/api/keys/{key_id}/rotate"),
        ("GET", "/api/usage"),
        ("GET", "/api/usage/series"),
        ("GET", "/api/usage/requests"),
    } <= found, found


def _expected(call: Call, actor: Key, target: Key) -> int:
    """The status the lattice gives, with the store's own answers for keys that are gone."""
    if (call.access is Access.ADMIN and actor.role != "admin") or (call.access is Access.TEAM and actor.role == "key"):
        return 403  # the router's role check, before any object
    if not call.manage:
        return 200 if sees(actor, target) else 403
    if not sees(actor, target):
        return 404
    if not manages(actor, target):
        return 403
    moving = call.body is not None and "team_id" in call.body and target.team != "b"
    if moving:
        if actor.role != "admin":
            return 403  # out of its scope
        if target.role == "admin":
            return 400  # admin keys belong to no team
    if target.revoked and (call.method in ("POST", "DELETE") or moving):
        return 404  # no active key to rotate, revoke or move
    return 200


def test_every_route_that_names_a_key_decides_on_the_key(server: Server, key_routes: list[Call]) -> None:
    """Routes x actors x targets; each answer as the lattice says, no secret in a refusal, and a refused
    change leaves the key as it was."""
    teams, actors, targets = _world(server.data_dir, "m")
    wrong = []
    cases = 0
    secrets = {key.id: key.secret for key in [*actors.values(), *targets.values()]}  # as rotations leave them
    for actor_kind in ACTORS:
        actor = actors[actor_kind]
        # Reads first, then changes, revocations last: each case sees the targets as made.
        ordered = sorted(key_routes, key=lambda c: (c.manage, c.method == "DELETE"))
        for call in ordered:
            for kind in TARGETS:
                target = actor if kind == "self" else targets[f"{actor_kind}/{kind}"]
                if kind == "self" and call.method == "DELETE" and actor_kind != "plain":
                    continue  # revoking itself ends the actor's own run; tested below
                path = call.path.replace("{key_id}", target.id)
                body = {k: teams["b"] if v == "{team_b}" else v for k, v in (call.body or {}).items()}
                headers = {"Authorization": f"Bearer {secrets[actor.id]}"}
                answer = httpx.request(
                    call.method, server.url + path, headers=headers, json=body if call.body else None, timeout=30
                )
                if answer.status_code == 200 and call.path.endswith("rotate?grace_seconds=0"):
                    secrets[target.id] = answer.json()["key"]
                cases += 1
                expected = _expected(call, actor, target)
                if answer.status_code != expected:
                    wrong.append((call.method, call.path, call.body, actor_kind, kind, answer.status_code, expected))
                if answer.status_code >= 400:
                    assert "key" not in answer.json(), answer.text  # never a secret in a refusal
                    if call.manage and not (target.revoked or target.expired):
                        me = httpx.get(
                            server.url + "/api/me", headers={"Authorization": f"Bearer {secrets[target.id]}"}
                        )
                        assert me.status_code == 200, (call, actor_kind, kind, me.text)
    assert not wrong, f"{len(wrong)} of {cases} cases:\n" + "\n".join(map(str, wrong))
    assert cases >= 340


def test_what_each_actor_lists_is_what_it_sees(server: Server) -> None:
    _teams, actors, targets = _world(server.data_dir, "l")
    everyone = {**{f"actor/{k}": v for k, v in actors.items()}, **targets}
    for kind, actor in actors.items():
        answer = httpx.get(server.url + "/api/keys", headers={"Authorization": f"Bearer {actor.secret}"})
        if actor.role == "key":
            assert_error(answer, 403, "permission_error")
            continue
        listed = {k["id"] for k in answer.json()["data"]}
        ours = {key.id for key in everyone.values()}
        assert listed & ours == {key.id for key in everyone.values() if sees(actor, key)}, kind


@pytest.mark.parametrize(
    ("made", "status"),
    [("admin", 403), ("team_admin_a", 403), ("team_admin_b", 403), ("member_a", 201), ("member_b", 403)],
)
def test_a_team_admin_makes_only_members_of_its_team(server: Server, made: str, status: int) -> None:
    teams, actors, _ = _world(server.data_dir, f"c{made}")
    role, team = _role_and_team(made)
    body: dict[str, object] = {"name": f"made-{made}", "admin": role == "admin", "team_admin": role == "team_admin"}
    if team is not None:
        body["team_id"] = teams[team]
    answer = httpx.post(
        server.url + "/api/keys", json=body, headers={"Authorization": f"Bearer {actors['team_admin_a'].secret}"}
    )
    assert answer.status_code == status, answer.text
    if status == 403:
        assert answer.json()["error"]["type"] == "permission_error" and "key" not in answer.json()


def test_an_admin_key_belongs_to_no_team(server: Server) -> None:
    teams, actors, targets = _world(server.data_dir, "t")
    admin = {"Authorization": f"Bearer {actors['admin'].secret}"}
    made = httpx.post(server.url + "/api/keys", json={"name": "x", "admin": True, "team_id": teams["a"]}, headers=admin)
    assert_error(made, 400, "invalid_request_error", "team_id")
    moved = httpx.patch(
        server.url + f"/api/keys/{targets['admin/admin'].id}", json={"team_id": teams["a"]}, headers=admin
    )
    assert_error(moved, 400, "invalid_request_error", "team_id")


def test_the_issues_escalation_is_refused(server: Server) -> None:
    """Issue 82's path: a team admin rotates an admin key in its team and makes an admin key with it."""
    _, actors, targets = _world(server.data_dir, "e")
    team_admin = {"Authorization": f"Bearer {actors['team_admin_a'].secret}"}
    for kind in ("admin_in_team_a", "team_admin_a"):
        target = targets[f"team_admin_a/{kind}"]
        rotated = httpx.post(server.url + f"/api/keys/{target.id}/rotate?grace_seconds=0", headers=team_admin)
        assert rotated.status_code in (403, 404) and "key" not in rotated.json(), rotated.text
        still = httpx.get(server.url + "/api/me", headers={"Authorization": f"Bearer {target.secret}"})
        assert still.status_code == 200


def test_an_admin_may_revoke_itself_and_a_team_admin_may_not(server: Server) -> None:
    _, actors, _ = _world(server.data_dir, "s")
    team_admin = actors["team_admin_a"]
    refused = httpx.delete(
        server.url + f"/api/keys/{team_admin.id}", headers={"Authorization": f"Bearer {team_admin.secret}"}
    )
    assert_error(refused, 403, "permission_error", "key_id")
    admin = actors["admin"]
    done = httpx.delete(server.url + f"/api/keys/{admin.id}", headers={"Authorization": f"Bearer {admin.secret}"})
    assert done.status_code == 200 and done.json()["revoked_at"]
