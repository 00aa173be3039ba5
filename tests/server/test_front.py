"""The app's front (`server/front.Front`): the generation endpoints' lane past FastAPI's router, where
what an endpoint raises is rendered as the app's handlers render it, and the body-size limit on a
body that declares no length. The endpoints themselves are tested end to end (tests/e2e); what no
endpoint raises on purpose is provoked here with stand-in endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from llmserver.app import _api_error, _unexpected
from llmserver.errors import InvalidRequest
from llmserver.server.front import Front


async def fine(request: Request) -> Response:
    return JSONResponse({"path": request.url.path, "body": (await request.body()).decode()})


async def refused(request: Request) -> Response:
    raise InvalidRequest("max_tokens is too large", param="max_tokens")


async def broken(request: Request) -> Response:
    raise RuntimeError("a bug")


async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"fallback": scope["method"]})(scope, receive, send)


async def chunked(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def call(method: str, path: str, content: bytes | list[bytes] = b"{}") -> httpx.Response:
    app = Front(
        fallback,
        max_bytes=16,
        quota=lambda: None,  # type: ignore[arg-type,return-value]  # no principal here: never asked
        audit=lambda: None,  # type: ignore[arg-type,return-value]  # no admin route here: never asked
        hot={"/fine": fine, "/refused": refused, "/broken": broken},
        api_error=_api_error,
        unexpected=_unexpected,
    )

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            if isinstance(content, bytes):
                return await client.request(method, path, content=content)
            return await client.request(method, path, content=chunked(content))  # no Content-Length

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


def test_a_body_without_a_length_is_counted_against_the_limit() -> None:
    # A declared length over the limit is refused before the body is read (tests/e2e/test_errors.py);
    # a chunked body declares none, so its bytes are counted as they arrive.
    assert call("POST", "/fine", [b"{", b"}"]).json() == {"path": "/fine", "body": "{}"}
    answer = call("POST", "/fine", [b"x" * 10, b"y" * 10])
    assert answer.status_code == 413
    assert answer.json()["error"]["type"] == "request_too_large"
    assert call("POST", "/fine", b"x" * 17).status_code == 413


def test_the_generation_endpoints_take_the_lane_from_the_apps_route_table(tmp_path: Path) -> None:
    from llmserver.api import anthropic, native, openai, responses
    from llmserver.app import create_app
    from llmserver.settings import Settings

    front = create_app(Settings(data_dir=tmp_path)).build_middleware_stack()
    assert isinstance(front, Front)
    assert front.hot == {
        "/api/generate": native.generate,
        "/v1/chat/completions": openai.chat_completions,
        "/v1/completions": openai.completions,
        "/v1/responses": responses.create_response,
        "/v1/responses/input_tokens": responses.input_tokens,
        "/v1/messages": anthropic.create_message,
        "/v1/messages/count_tokens": anthropic.count_tokens,
    }  # empty, every request went through FastAPI's routing: 0.12 ms more each (bench.instant)


def test_a_dependency_or_a_middleware_takes_a_direct_route_through_fastapi() -> None:
    """The lane past FastAPI is for routes FastAPI would run nothing else for: a dependency on a direct
    route (its own, its router's or the app's) runs, and so does a middleware added to the app."""
    from fastapi import APIRouter, Depends, FastAPI

    from llmserver.api.deps import direct
    from llmserver.app import Gateway

    ran: list[str] = []

    async def checked() -> None:
        ran.append("dependency")

    router = APIRouter()

    @router.post("/plain")
    @direct
    async def plain(request: Request) -> Response:
        return JSONResponse({"plain": True})

    @router.post("/guarded", dependencies=[Depends(checked)])
    @direct
    async def guarded(request: Request) -> Response:
        return JSONResponse({"guarded": True})

    def served(app: FastAPI, path: str) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return await client.post(path, content=b"{}")

        return asyncio.run(go())

    def gateway() -> Gateway:
        app = Gateway()
        app.include_router(router)
        app.front = lambda stack, hot: Front(
            stack, max_bytes=1024, quota=lambda: None, audit=lambda: None,  # type: ignore[arg-type,return-value]
            hot=hot, api_error=_api_error, unexpected=_unexpected,
        )  # fmt: skip
        return app

    app = gateway()
    front = app.build_middleware_stack()
    assert isinstance(front, Front) and front.hot == {"/plain": plain}
    assert served(app, "/guarded").json() == {"guarded": True} and ran == ["dependency"]
    assert served(app, "/plain").json() == {"plain": True} and ran == ["dependency"]

    app = gateway()

    @app.middleware("http")
    async def seen(request: Request, call_next):  # type: ignore[no-untyped-def]
        ran.append(f"middleware {request.url.path}")
        return await call_next(request)

    front = app.build_middleware_stack()
    assert isinstance(front, Front) and front.hot == {}
    assert served(app, "/plain").json() == {"plain": True}
    assert ran == ["dependency", "middleware /plain"]
