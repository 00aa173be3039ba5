"""Authorization from the route table: every route of the app (FastAPI's table, the console's and the
fast lane's included) is called on the real server without a key, with a revoked key, and with a user
key. Only the routes in `access.PUBLIC` answer without a key; every admin route refuses a user key.
A new route that declares no access fails the app's build (`check_routes`) and so this module."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route

from llmserver.api.access import PUBLIC, PUBLIC_MOUNTS, Access, access_of, app_routes, check_routes, router
from llmserver.app import create_app
from llmserver.settings import Settings
from tests.support import Server, cli, make_key, make_key_record


def _table(tmp_path: Path) -> list[tuple[str, str, Access | None]]:
    """(method, path with its parameters filled, declared access) for every route of the app."""
    app = create_app(Settings(data_dir=tmp_path))
    calls: list[tuple[str, str, Access | None]] = []
    for route in app_routes(app.routes):
        if isinstance(route, Mount):
            calls.append(("GET", route.path + "/console.js", Access.PUBLIC))
            continue
        assert isinstance(route, Route), route
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        access = access_of(route) if isinstance(route, APIRoute) else Access.PUBLIC
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                calls.append((method, path, access))
    return calls


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, Access | None]]:
    return _table(tmp_path_factory.mktemp("routes"))


def _call(server: Server, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = b'{"model": "x", "name": "x"}' if method in ("POST", "PUT", "PATCH") else None
    return httpx.request(method, server.url + path, headers=headers, content=body, timeout=30)


def test_the_table_holds_every_surface(table: list[tuple[str, str, Access | None]]) -> None:
    paths = {path for _, path, _ in table}
    assert {"/api/models/x", "/api/keys/x", "/api/instances/x", "/v1/chat/completions", "/metrics"} <= paths
    assert {("DELETE", "/api/models/x"), ("PATCH", "/api/keys/x")} <= {(m, p) for m, p, _ in table}
    assert all(access is not None for _, _, access in table)
    assert {path for _, path, access in table if access is Access.PUBLIC} <= PUBLIC | {
        m + "/console.js" for m in PUBLIC_MOUNTS
    }


def test_every_route_but_the_public_ones_refuses_a_call_without_a_key(
    server: Server, table: list[tuple[str, str, Access | None]]
) -> None:
    answered = {}
    for method, path, access in table:
        if access is Access.PUBLIC:
            continue
        answer = _call(server, method, path, None)
        answered[method, path] = (answer.status_code, answer.json()["error"]["type"])
    assert answered and set(answered.values()) == {(401, "authentication_error")}, answered


def test_a_revoked_key_is_refused_everywhere(server: Server, table: list[tuple[str, str, Access | None]]) -> None:
    key_id, key = make_key_record(server.data_dir, "revoked", admin=True)
    revoked = cli(server.data_dir, "keys", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    answered = {}
    for method, path, access in table:
        if access is not Access.PUBLIC:
            answer = _call(server, method, path, key)
            answered[method, path] = answer.status_code
    assert set(answered.values()) == {401}, answered


def test_every_admin_route_refuses_a_user_key(server: Server, table: list[tuple[str, str, Access | None]]) -> None:
    key = make_key(server.data_dir, "user")
    admin_routes = [(method, path) for method, path, access in table if access is Access.ADMIN]
    assert ("DELETE", "/api/models/x") in admin_routes and ("POST", "/api/instances") in admin_routes
    answered = {}
    for method, path in admin_routes:
        answer = _call(server, method, path, key)
        answered[method, path] = (answer.status_code, answer.json()["error"]["type"])
    assert set(answered.values()) == {(403, "permission_error")}, answered


def test_a_model_cannot_be_deleted_without_an_admin_key(server: Server) -> None:
    """Issue 54's first row: DELETE /api/models/NAME answered 200 to anyone."""
    admin = make_key(server.data_dir, "admin", admin=True)
    user = make_key(server.data_dir, "user")
    headers = {"Authorization": f"Bearer {admin}"}
    added = httpx.post(
        server.url + "/api/models", headers=headers, json={"name": "deletable", "min_instances": 0}, timeout=60
    )
    assert added.status_code == 201, added.text
    try:
        assert httpx.delete(server.url + "/api/models/deletable", timeout=30).status_code == 401
        answer = httpx.delete(server.url + "/api/models/deletable", headers={"Authorization": f"Bearer {user}"})
        assert answer.status_code == 403
        assert httpx.get(server.url + "/api/models/deletable", headers=headers).status_code == 200
    finally:
        assert httpx.delete(server.url + "/api/models/deletable", headers=headers, timeout=60).status_code == 200


def test_a_route_that_declares_no_access_stops_the_build(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))
    check_routes(app)

    @app.delete("/api/forgotten")
    async def forgotten() -> dict[str, str]:
        return {}

    with pytest.raises(RuntimeError, match="/api/forgotten declares no access"):
        check_routes(app)


def test_a_public_route_must_be_listed(tmp_path: Path) -> None:
    app = FastAPI()
    public = router(Access.PUBLIC)

    @public.get("/api/secret")
    async def secret() -> dict[str, str]:
        return {}

    app.include_router(public)
    with pytest.raises(RuntimeError, match="not listed"):
        check_routes(app)


def test_every_team_route_refuses_a_user_key_and_every_admin_route_a_team_admin_key(
    server: Server, table: list[tuple[str, str, Access | None]]
) -> None:
    """The team admin role (Access.TEAM: an admin key or a team admin key): a user key gets none of its
    routes, and a team admin key none of the admin routes."""
    admin = {"Authorization": f"Bearer {make_key(server.data_dir, 'admin-of-teams', admin=True)}"}
    team = httpx.post(server.url + "/api/teams", json={"name": "access-team"}, headers=admin).json()
    made = httpx.post(
        server.url + "/api/keys", json={"name": "access-team-admin", "team_id": team["id"], "team_admin": True},
        headers=admin,
    )  # fmt: skip
    assert made.status_code == 201 and made.json()["team_admin"], made.text
    team_admin, user = made.json()["key"], make_key(server.data_dir, "user")
    team_routes = [(method, path) for method, path, access in table if access is Access.TEAM]
    admin_routes = [(method, path) for method, path, access in table if access is Access.ADMIN]
    assert ("POST", "/api/keys") in team_routes and ("POST", "/api/teams") in admin_routes
    answered = {}
    for (method, path), key in [
        *((route, user) for route in team_routes),
        *((route, team_admin) for route in admin_routes),
    ]:
        answer = _call(server, method, path, key)
        answered[method, path] = (answer.status_code, answer.json()["error"]["type"])
    assert set(answered.values()) == {(403, "permission_error")}, answered


def test_the_consoles_audit_filter_offers_every_action_the_route_table_audits(tmp_path: Path) -> None:
    """Every changing route of an admin or team admin writes an audit row named by `action_of`; the
    console's action filter offers exactly those names (it once lacked keys.rotate and the teams' three)."""
    from llmserver.auth.audit import CHANGING, action_of
    from llmserver.cluster.nodes import ACTIONS

    app = create_app(Settings(data_dir=tmp_path))
    audited = set()
    for route in app_routes(app.routes):
        if not isinstance(route, APIRoute) or access_of(route) not in (Access.ADMIN, Access.TEAM):
            continue
        names = re.findall(r"\{([^}]+)\}", route.path_format)
        for method in (route.methods or set()) & CHANGING:
            values = ACTIONS if "action" in names else ["x"]
            for value in values:
                params = {name: value if name == "action" else "x" for name in names}
                audited.add(action_of(method, route.path_format, params)[0])
    script = (Path(__file__).resolve().parents[2] / "src/llmserver/console/static/console.js").read_text()
    listed = re.search(r"const AUDIT_ACTIONS = \[(.*?)\];", script, re.S)
    assert listed is not None
    assert set(re.findall(r'"([a-z]+\.[a-z_]+)"', listed.group(1))) == audited
    assert {"keys.rotate", "teams.create", "nodes.drain"} <= audited
    # and the audit log's page lists every one of them (it once lacked keys.rotate: issue 82)
    page = (Path(__file__).resolve().parents[2] / "docs/operating/audit.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `action` |"))
    # (instances.* unquoted there: the docs' check reads a quoted `instances.x` as a setting's name)
    assert set(re.findall(r"\b((?:keys|teams|models|instances|nodes)\.[a-z_]+)\b", row)) == audited
