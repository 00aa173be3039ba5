"""The web console: one page (`GET /console`) and its assets, all from the installed package.

The page is static: it signs in with an API key kept in the tab's sessionStorage and calls the same
HTTP API as any client (/api/me, /api/instances, /api/keys, /api/usage/series, /v1/models,
/v1/chat/completions, /api/generate in async mode). Nothing comes from the internet at run time:
the one third-party asset, libsodium's JavaScript build (for decrypting async results in the
browser), is fetched from npm's registry by scripts/setup.sh into `static/vendor/` and checked
against its published hash (scripts/fetch_assets.py).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC = Path(__file__).parent / "static"

# The page may talk to this server only; WebAssembly is libsodium's.
POLICY = (
    "default-src 'none'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = [
    (b"content-security-policy", POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class _Headers:
    """Headers added to every answer of the wrapped app."""

    def __init__(self, app: ASGIApp, headers: list[tuple[bytes, bytes]]) -> None:
        self.app, self.headers = app, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, with_headers)


def install(app: FastAPI) -> None:
    page = STATIC / "index.html"

    @app.get("/console", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(page, headers={"Cache-Control": "no-cache", **{k.decode(): v.decode() for k, v in HEADERS}})

    @app.get("/console/", include_in_schema=False)
    async def console_slash() -> RedirectResponse:
        return RedirectResponse("/console")

    # Compressed for clients that take gzip (libsodium.js: 639 kB, 232 kB gzipped); kept by the browser but
    # revalidated on each use (ETag, Last-Modified: a 304 costs no body), since their names carry no version.
    assets = GZipMiddleware(StaticFiles(directory=STATIC), minimum_size=1024, compresslevel=6)
    revalidated = [*HEADERS, (b"cache-control", b"no-cache")]
    app.mount("/console/assets", _Headers(assets, revalidated), name="console-assets")
