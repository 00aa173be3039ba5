"""The web console: one page (`GET /console`) and its assets, all from the installed package.

The page is static: it signs in with an API key kept in the tab's sessionStorage and calls the same
HTTP API as any client (/api/me, /api/instances, /api/models, /api/keys, /api/usage,
/api/usage/series, /api/usage/requests, /v1/models, /v1/chat/completions, /api/generate in async
mode). Nothing comes from the internet at run time:
the one third-party asset, libsodium's JavaScript build (for decrypting async results in the
browser), is fetched from npm's registry by scripts/setup.sh into `static/vendor/` and checked
against its published hash (scripts/fetch_assets.py).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserver.api.access import Access, router

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


def version(folder: Path = STATIC) -> str:
    """The assets' version: a hash of every file's name and bytes (index.html's own aside), so that
    any change to any asset gives every asset URL a new name."""
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "index.html"):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


VERSIONED = re.compile(r"/([0-9a-f]{16})(/.*)")


class _Versioned:
    """/console/assets/<version>/<file>: the file, kept by browsers for a year unasked when <version> is
    the current one (the page names it, so a new build is fetched under a new name at once); under any
    other version (a page loaded before an upgrade) the current file, revalidated. Unversioned names
    (/console/assets/<file>) stay, revalidated on each use."""

    def __init__(self, app: ASGIApp, current: str) -> None:
        self.current = current
        self.immutable = _Headers(app, [*HEADERS, (b"cache-control", b"public, max-age=31536000, immutable")])
        self.revalidated = _Headers(app, [*HEADERS, (b"cache-control", b"no-cache")])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = scope.get("root_path", "")
        path = scope["path"][len(root) :] if scope["path"].startswith(root) else scope["path"]
        app = self.revalidated
        found = VERSIONED.fullmatch(path)
        if found is not None:
            if found[1] == self.current:
                app = self.immutable
            scope = {**scope, "path": root + found[2]}
        await app(scope, receive, send)


def install(app: FastAPI) -> None:
    current = version()
    # The page names its assets under their version; it is itself revalidated on every load (its ETag
    # changes with any asset), so a new build reaches a browser on its next load.
    page = (STATIC / "index.html").read_text().replace("/console/assets/", f"/console/assets/{current}/").encode()
    etag = f'"{hashlib.blake2b(page, digest_size=8).hexdigest()}"'
    page_headers = {"Cache-Control": "no-cache", "ETag": etag, **{k.decode(): v.decode() for k, v in HEADERS}}

    routes = router(Access.PUBLIC)

    @routes.get("/console", include_in_schema=False)
    async def console(request: Request) -> Response:
        if etag in (request.headers.get("if-none-match") or ""):
            return Response(status_code=304, headers=page_headers)
        return Response(page, media_type="text/html; charset=utf-8", headers=page_headers)

    @routes.get("/console/", include_in_schema=False)
    async def console_slash() -> RedirectResponse:
        return RedirectResponse("/console")

    app.include_router(routes)
    # Compressed for clients that take gzip (libsodium.js: 639 kB, 232 kB gzipped).
    assets = GZipMiddleware(StaticFiles(directory=STATIC), minimum_size=1024, compresslevel=6)
    app.mount("/console/assets", _Versioned(assets, current), name="console-assets")
