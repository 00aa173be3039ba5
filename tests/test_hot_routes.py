"""The generation endpoints' lane past FastAPI's router (`api/hot.py`): what its endpoints raise is
rendered as the app's handlers render it. The endpoints themselves are tested end to end
(tests/e2e); an exception no endpoint raises on purpose is provoked here with stand-in endpoints."""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from llmserver.api.hot import HotRoutes
from llmserver.app import _api_error, _unexpected
from llmserver.errors import InvalidRequest


async def fine(request: Request) -> Response:
    return JSONResponse({"path": request.url.path, "body": (await request.body()).decode()})


async def refused(request: Request) -> Response:
    raise InvalidRequest("max_tokens is too large", param="max_tokens")


async def broken(request: Request) -> Response:
    raise RuntimeError("a bug")


async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"fallback": scope["method"]})(scope, receive, send)


def call(method: str, path: str) -> httpx.Response:
    app = HotRoutes(
        fallback, {"/fine": fine, "/refused": refused, "/broken": broken}, api_error=_api_error, unexpected=_unexpected
    )

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, content=b"{}")

    return asyncio.run(go())


def test_a_hot_endpoint_answers_and_other_methods_and_paths_fall_through() -> None:
    assert call("POST", "/fine").json() == {"path": "/fine", "body": "{}"}
    assert call("GET", "/fine").json() == {"fallback": "GET"}
    assert call("POST", "/elsewhere").json() == {"fallback": "POST"}


def test_errors_are_the_envelope() -> None:
    answer = call("POST", "/refused")
    assert answer.status_code == 400
    assert answer.json() == {
        "error": {
            "message": "max_tokens is too large",
            "type": "invalid_request_error",
            "code": 400,
            "param": "max_tokens",
        }
    }
    answer = call("POST", "/broken")
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "server_error"
    assert "a bug" not in answer.text  # logged, never shown
