"""Who may call what, declared once per router and checked from the route table.

Every router is made by `router(access)`:
- `Access.ADMIN`: the router carries `admin_key` as a dependency, so none of its routes can forget it;
- `Access.KEY`: the router carries `any_key`; the endpoint reads the caller with `caller(request)`;
- `Access.TEAM`: an admin key or a team admin key (`team_key`); the endpoint limits a team admin to its
  own team's keys (api/keys.py);
- `Access.NODE`: a worker node's key (`instances.api_key`, which nodes and gateways share) or an admin
  key: what nodes fetch from a gateway (a catalog model's file);
- `Access.PUBLIC`: no key, and only for the paths in `PUBLIC` below;
- `Access.OWN`: the endpoint authenticates itself first thing: the generating endpoints, which take
  a key in their body and gate a large body before reading it (`deps.parse`, with the fast lane of
  `deps.direct` skipping FastAPI's dependencies), and `/metrics` with its scrape token.

`check_routes(app)` runs when the app is built and refuses a route whose router declared nothing, or a
public route whose path is not listed here; `tests/api/test_access.py` calls every route of the app
without a key, with a user key and with a revoked key.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Mount

from llmserver.api.deps import audit, authenticate, header_key, json_body, settings
from llmserver.auth.audit import CHANGING
from llmserver.auth.keys import Principal
from llmserver.errors import APIError, InvalidRequest, PermissionDenied
from llmserver.logs import request_id


class Access(enum.Enum):
    PUBLIC = "public"
    KEY = "key"
    ADMIN = "admin"
    TEAM = "team"
    NODE = "node"
    OWN = "own"


# The routes anyone may call, without a key: liveness, readiness, the API's description, the console's
# page and its assets (the console signs in with a key against the API itself).
PUBLIC = frozenset({"/health", "/ready", "/openapi.json", "/console", "/console/"})
PUBLIC_MOUNTS = frozenset({"/console/assets"})

# Methods whose body may carry `api_key` (as everywhere in the API).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def _caller(request: Request, *, admin: bool, team: bool = False) -> Principal:
    """The key (header, query string, or the body's `api_key`), checked before anything else: a bad key
    is a 401 whatever the body; a body's own problem is kept for the endpoint (`body_of`)."""
    body: dict[str, Any] | None = None
    problem: APIError | None = None
    if request.method in BODY_METHODS:
        try:
            body = await json_body(request)
        except APIError as exc:
            problem = exc
    principal = await authenticate(request, body)
    if admin and request.method in CHANGING:
        # An admin action: the front appends its row with the answer. A key refused here is recorded with
        # its 403 (a team admin trying an admin route: what a security team looks for first).
        route: APIRoute = request.scope["route"]
        request.state.audit = audit(request).note(
            method=request.method, path_format=route.path_format, path_params=request.path_params,
            key_id=principal.key_id, key_name=principal.name, body=body, query=request.query_params,
            client=request.client.host if request.client else None, request_id=request_id.get(),
        )  # fmt: skip
    if admin and not principal.is_admin and not (team and principal.team_admin):
        raise PermissionDenied(f"This endpoint needs an admin key{' or a team admin key' if team else ''}.")
    request.state.body = body
    request.state.body_problem = problem
    return principal


async def admin_key(request: Request) -> Principal:
    return await _caller(request, admin=True)


async def any_key(request: Request) -> Principal:
    return await _caller(request, admin=False)


async def team_key(request: Request) -> Principal:
    """An admin key, or a team admin key (whose actions are audited as an admin's are)."""
    return await _caller(request, admin=True, team=True)


NODE_PRINCIPAL = Principal(key_id="node", name="a worker node", fingerprint="instances.api_key", is_admin=False)


async def node_key(request: Request) -> Principal:
    """A worker node, by the instance key it shares with the gateways; else an admin key."""
    expected, presented = settings(request).instances.key, header_key(request)
    if expected and presented and hmac.compare_digest(presented.encode(), expected.encode()):
        request.state.principal = NODE_PRINCIPAL
        return NODE_PRINCIPAL
    return await _caller(request, admin=True)


_DEPENDENCY = {Access.ADMIN: admin_key, Access.KEY: any_key, Access.TEAM: team_key, Access.NODE: node_key}


def router(access: Access) -> APIRouter:
    """A router whose every route has `access`."""
    dependency = _DEPENDENCY.get(access)
    made = APIRouter(dependencies=[Depends(dependency)] if dependency else [])
    made.tags = [f"access:{access.value}"]
    return made


def caller(request: Request) -> Principal:
    """The key the router's dependency authenticated."""
    principal: Principal = request.state.principal
    return principal


def body_of(request: Request) -> dict[str, Any]:
    """The JSON body of a KEY or ADMIN route, read while its key was checked; `api_key` taken out."""
    problem: APIError | None = getattr(request.state, "body_problem", None)
    found: dict[str, Any] | None = getattr(request.state, "body", None)
    if problem is not None:
        raise problem
    if found is None:
        raise InvalidRequest("The request body must be a JSON object.")
    found.pop("api_key", None)
    return found


def access_of(route: APIRoute) -> Access | None:
    """What a route declared through its router, None when nothing."""
    declared = [tag for tag in route.tags if isinstance(tag, str) and tag.startswith("access:")]
    if len(declared) != 1:
        return None
    access = Access(declared[0].removeprefix("access:"))
    needed = _DEPENDENCY.get(access)
    if needed is not None and not any(d.dependency is needed for d in route.dependencies):
        return None  # declared, but its dependency is gone: refuse rather than trust the tag
    return access


def app_routes(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, those of included routers too (newer FastAPI keeps an included router as one entry
    of `app.routes` that holds the router's own routes, each with the router's dependencies and tags)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from app_routes(included.routes)
        else:
            yield route


def check_routes(app: FastAPI) -> None:
    """Refuse to build an app with a route that declares no access, or a public route not in PUBLIC."""
    for route in app_routes(app.routes):
        if isinstance(route, Mount):
            if route.path not in PUBLIC_MOUNTS:
                raise RuntimeError(f"the mount {route.path} is not a listed public one")
            continue
        if not isinstance(route, APIRoute):
            continue  # Starlette's own routes: /openapi.json (listed public)
        access = access_of(route)
        if access is None:
            raise RuntimeError(f"route {route.path} declares no access: make its router with access.router()")
        if access is Access.PUBLIC and route.path not in PUBLIC:
            raise RuntimeError(f"route {route.path} is public but not listed in access.PUBLIC")
        if getattr(route.endpoint, "direct", False) and access is not Access.OWN:
            # The fast lane calls a direct endpoint past FastAPI's dependencies: it must check its own key.
            raise RuntimeError(f"route {route.path} is direct, so its router must be Access.OWN")
