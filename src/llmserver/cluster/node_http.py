"""`llmserver node`'s own small HTTP listener: `/health`, `/ready` and `/metrics` (on `node_port`), and the
node's saved prompt caches for gateways that carry a conversation to another node (cluster/transfer.py).

`/ready` is 200 when Redis answers, the node published its instances within the last 3 s, and every
model kept at `min_instances > 0` has an instance that serves (health.py). `/metrics` carries the
node's instances by model and status, its cold starts, evictions and watchdog restarts, and the
components' states; it takes `metrics_token` or `instance_api_key` as a bearer token (or nothing,
with `metrics_public`).

`GET /prompts/IDENTITY/NAME` answers a saved state of this node's prompt folder of that identity, sealed;
`PUT` the same path opens one into it. Both take only a request signed with the instance key (no key, no
transfer: 401 for all) and exist only while this node saves prompts (`prompt_cache.disk_mb` > 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmserver.cluster import transfer
from llmserver.errors import AuthenticationError, error_body
from llmserver.health import Readiness
from llmserver.metrics.prometheus import Metrics
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import Settings

log = logging.getLogger("llmserver.node")


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

    saved = supervisor.saved_prompts
    instance_key = settings.instances.key

    def unsigned(request: Request) -> Response | None:
        """The envelope for a transfer request that the instance key did not sign; None if it did."""
        header = request.headers.get("authorization", "")
        if instance_key is not None and transfer.signed(instance_key, header, request.method, request.url.path):
            return None
        error = error_body(401, "authentication_error", "A saved prompt transfer must be signed with the instance key")
        return JSONResponse(error, status_code=401)

    def folder_of(identity: str) -> Path | None:
        """This node's prompt folder of `identity` (one of its models' instances started on it), if any."""
        assert saved is not None
        if not transfer.IDENTITY.fullmatch(identity):
            return None
        return next((path for path in saved.root.glob(f"*/{identity}") if path.is_dir()), None)

    def not_here(what: str) -> Response:
        return JSONResponse(error_body(404, "not_found_error", what), status_code=404)

    async def prompt(request: Request) -> Response:
        if (refusal := unsigned(request)) is not None:
            return refusal
        identity, name = request.path_params["identity"], request.path_params["name"]
        if not transfer.NAME.fullmatch(name):
            error = error_body(400, "invalid_request_error", "Not the name of a saved prompt cache", param="name")
            return JSONResponse(error, status_code=400)
        folder = await asyncio.to_thread(folder_of, identity)
        if folder is None:
            return not_here(f"No prompt folder of identity {identity} on this node")
        assert instance_key is not None
        if request.method == "GET":
            if not await asyncio.to_thread((folder / name).is_file):
                return not_here(f"No saved prompt cache {name} here")
            sealed = transfer.sealed(folder / name, instance_key, identity, name)
            return StreamingResponse(sealed, media_type="application/octet-stream")
        assert saved is not None
        try:
            size = await transfer.open_into(request.stream(), instance_key, identity, folder, name, saved.budget_bytes)
        except transfer.TransferError as exc:
            log.warning("a saved prompt cache sent to this node was refused: %s", exc)
            error = error_body(400, "invalid_request_error", f"Saved prompt cache refused: {exc}")
            return JSONResponse(error, status_code=400)
        saved.disk_bytes += size
        return JSONResponse({"name": name, "bytes": size}, status_code=201)

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            error = error_body(405, "invalid_request_error", f"Method {request.method} is not allowed here")
        else:
            error = error_body(404, "not_found_error", f"No such endpoint: {request.method} {request.url.path}")
        return JSONResponse(error, status_code=exc.status_code)

    routes = [Route("/health", health), Route("/ready", ready), Route("/metrics", scrape)]
    if saved is not None and saved.enabled:
        routes.append(Route("/prompts/{identity}/{name}", prompt, methods=["GET", "PUT"]))
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: refused},
    )


class NodeServer(uvicorn.Server):
    """uvicorn's server inside the node's loop: the node's own signal handlers stop it (uvicorn's
    would replace them, and re-raise the signal once it stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
