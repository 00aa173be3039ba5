"""`llmserver node`'s own small HTTP listener: `/health`, `/ready` and `/metrics` (on `node_port`).

`/ready` is 200 when Redis answers, the node published its instances within the last 3 s, and every
model kept at `min_instances > 0` has an instance that serves (health.py). `/metrics` carries the
node's instances by model and status, its cold starts, evictions and watchdog restarts, and the
components' states; it takes `metrics_token` or `instance_api_key` as a bearer token (or nothing,
with `metrics_public`).
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserver.errors import AuthenticationError, error_body
from llmserver.health import Readiness
from llmserver.metrics.prometheus import Metrics
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import Settings


def node_app(settings: Settings, supervisor: Supervisor, readiness: Readiness, metrics: Metrics) -> Starlette:
    tokens = [
        s.get_secret_value().encode() for s in (settings.observability.metrics_token, settings.instances.api_key) if s
    ]

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        await readiness.check()
        body = readiness.body()
        body["models"] = {name: pool.ready for name, pool in supervisor.pools.items()}
        return JSONResponse(body, status_code=200 if readiness.ready else 503)

    async def scrape(request: Request) -> Response:
        if not settings.observability.metrics_public:
            scheme, _, presented = request.headers.get("authorization", "").partition(" ")
            given = presented.strip().encode()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, token) for token in tokens):
                error = AuthenticationError()
                return JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
        await readiness.check()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            error = error_body(405, "invalid_request_error", f"Method {request.method} is not allowed here")
        else:
            error = error_body(404, "not_found_error", f"No such endpoint: {request.method} {request.url.path}")
        return JSONResponse(error, status_code=exc.status_code)

    return Starlette(
        routes=[Route("/health", health), Route("/ready", ready), Route("/metrics", scrape)],
        exception_handlers={HTTPException: refused},
    )


class NodeServer(uvicorn.Server):
    """uvicorn's server inside the node's loop: the node's own signal handlers stop it (uvicorn's
    would replace them, and re-raise the signal once it stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
