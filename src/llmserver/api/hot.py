"""The generation endpoints' lane past FastAPI's router.

Every request to a generating endpoint crossed Starlette's exception middleware, two exception
wrappers, FastAPI's exit-stack middleware, the route table and FastAPI's request handler (its
dependency solver, its response checks): about 170 Python calls a request, of the 1,200 a tiny
generation took. Those endpoints take nothing from FastAPI (they read their own bodies, see
`api/deps.parse`), so `HotRoutes`, the innermost of the app's middlewares, calls them directly and
renders their errors as the app's exception handlers do (`errors`: the one envelope). They stay
registered with FastAPI as well, where the OpenAPI document and any other method on their paths
find them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserver.errors import APIError

Endpoint = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class HotRoutes:
    def __init__(
        self, app: ASGIApp, routes: Mapping[str, Endpoint], api_error: ErrorHandler, unexpected: ErrorHandler
    ) -> None:
        self.app = app
        self.routes = routes  # path → endpoint, for POST
        self.api_error = api_error
        self.unexpected = unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except APIError as exc:
            response = await self.api_error(request, exc)
        except Exception as exc:
            response = await self.unexpected(request, exc)
        await response(scope, receive, send)
