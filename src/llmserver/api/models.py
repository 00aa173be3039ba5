"""GET /v1/models: the seed's model list, with each model's 30-day average speed once it has one; and
the model catalog's admin API, GET/POST/PATCH/DELETE /api/models; a model's file for the nodes that lack it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse

from llmserver.api.access import Access, body_of, caller, router
from llmserver.api.deps import lineup, settings, speed, store, supervisor
from llmserver.auth.keys import allowed
from llmserver.errors import InvalidRequest, NotFound
from llmserver.models import catalog as model_catalog
from llmserver.models.files import CHECKSUM_HEADER, file_checksum
from llmserver.settings import FileRoots

keyed = router(Access.KEY)
admin = router(Access.ADMIN)
node = router(Access.NODE)
routers = (keyed, admin, node)


@keyed.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    principal = caller(request)
    config = settings(request)
    created = int(request.app.state.started_at)
    pools = supervisor(request).pools
    data = []
    for model in lineup(request):
        if not allowed(principal, model.name):
            continue
        entry: dict[str, Any] = {"id": model.name, "object": "model", "created": created, "owned_by": config.owned_by}
        average = speed(request).average(model.name)  # in memory: no ledger scan; omitted while there is no data
        if average is not None:
            entry["avg_tokens_per_second"] = average
        entry["vision_capable"] = model.vision_capable
        entry["embedding"] = model.embedding
        # Whether a request for it can be served: not stopped (max_instances 0) nor blocked (a file that
        # cannot be read, a setting that cannot run); pickers (the console's playground) list only these.
        pool = pools.get(model.name)
        entry["available"] = model.max_instances > 0 and (pool is None or pool.blocked is None)
        data.append(entry)
    return {"object": "list", "data": data}


# The model catalog (admin keys only): models/catalog.py


def _catalog(request: Request) -> model_catalog.CatalogFollower:
    follower: model_catalog.CatalogFollower = request.app.state.catalog
    return follower


def _status(request: Request, name: str, nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """How a model runs, as this gateway sees it; `fetching`: where its file is being downloaded (this
    host, node null, and the worker nodes whose records (`nodes`) say so), bytes so far of total;
    `last_start_failure`: the latest instance of it that failed to start, here or on a node, with why
    and the last lines of its llama-server log."""
    pool = supervisor(request).pools.get(name)
    fetching = [{"node": None, **pool.fetching}] if pool is not None and pool.fetching else []
    fetching += [{"node": n["node"], **n["fetching"][name]} for n in nodes or [] if name in (n.get("fetching") or {})]
    failures = [{"node": None, **pool.last_start_failure}] if pool is not None and pool.last_start_failure else []
    failures += [{"node": n["node"], **n["failures"][name]} for n in nodes or [] if name in (n.get("failures") or {})]
    last_failure = max(failures, key=lambda f: float(str(f["at"]))) if failures else None
    if pool is None:
        return {
            "instances": 0, "ready_instances": 0, "queue_depth": 0, "blocked": None, "fetching": fetching,
            "last_start_failure": last_failure,
        }  # fmt: skip
    return {
        "instances": len(pool.live()),
        "ready_instances": sum(1 for i in pool.instances if i.accepting),
        "queue_depth": pool.queue_depth,
        "blocked": pool.blocked,
        "fetching": fetching,
        "last_start_failure": last_failure,
    }


async def _nodes(request: Request) -> list[dict[str, Any]]:
    """The worker nodes' records (none on a server that runs its instances itself)."""
    registry = request.app.state.registry
    nodes: list[dict[str, Any]] = await registry.commands.nodes() if registry is not None else []
    return nodes


@node.get("/api/models/{name}/file", response_model=None)
async def model_file(request: Request, name: str) -> FileResponse:
    """A catalog model's GGUF as this gateway's host has it, for a worker node that lacks it
    (`node.gateway_url`): its SHA-256 in X-Checksum-SHA256, ranges honoured (a cut download resumes)."""
    entry = await model_catalog.find(store(request), name)
    if entry is None:
        raise NotFound(f"The model catalog has no model {name!r}.", param="name")
    given = entry.settings().get("path")
    roots = settings(request).model_file_roots()
    found = await asyncio.to_thread(_file_here, str(given), roots) if given else None
    if found is None:
        raise NotFound(
            f"This gateway has no file for the model {name!r} inside the directories model files may be in "
            f"(its path: {given or 'none'}).",
            param="name",
        )
    path, checksum = found
    return FileResponse(path, media_type="application/octet-stream", headers={CHECKSUM_HEADER: checksum})


@node.head("/api/models/{name}/file", response_model=None)
async def model_file_head(request: Request, name: str) -> FileResponse:
    """Its size and SHA-256, without the file."""
    return await model_file(request, name)


def _file_here(given: str, roots: FileRoots) -> tuple[Path, str] | None:
    """The file as it is now, links followed, if it is a file inside `roots`: checked as it is opened, never
    trusted from when the model's row was written (a link put there since would lead anywhere)."""
    path = roots.inside(Path(given))
    return (path, file_checksum(path)) if path is not None and path.is_file() else None


@admin.get("/api/models")
async def list_catalog(request: Request) -> dict[str, Any]:
    entries, nodes = await store(request).catalog(), await _nodes(request)
    data = [model_catalog.entry_body(entry, _status(request, entry.name, nodes)) for entry in entries]
    return {"object": "list", "data": data}


@admin.get("/api/models/{name}")
async def get_model(request: Request, name: str) -> dict[str, Any]:
    entry = await model_catalog.find(store(request), name)
    if entry is None:
        raise NotFound(f"The model catalog has no model {name!r}.", param="name")
    return model_catalog.entry_body(entry, _status(request, name, await _nodes(request)))


@admin.post("/api/models", status_code=201, response_model=None)
async def add_model(request: Request) -> JSONResponse:
    """Add a model to the catalog: every gateway serves it within seconds (this one at once)."""
    entry = await model_catalog.add(store(request), body_of(request), settings(request).model_file_roots())
    await _catalog(request).refresh()
    return JSONResponse(model_catalog.entry_body(entry, _status(request, entry.name)), status_code=201)


@admin.patch("/api/models/{name}")
async def update_model(request: Request, name: str) -> dict[str, Any]:
    """Change a model's settings: those an instance must restart for roll its instances over one by one."""
    entry = await model_catalog.update(store(request), name, body_of(request), settings(request).model_file_roots())
    await _catalog(request).refresh()
    return model_catalog.entry_body(entry, _status(request, name))


@admin.post("/api/models/{name}/stop")
async def stop_model(request: Request, name: str) -> dict[str, Any]:
    """Stop a model now and keep its row (max_instances 0): its instances drain, its requests are answered
    503 at once, until POST /api/models/{name}/start."""
    entry = await model_catalog.stop(store(request), name, settings(request).model_file_roots())
    await _catalog(request).refresh()
    return model_catalog.entry_body(entry, _status(request, name))


@admin.post("/api/models/{name}/start")
async def start_model(request: Request, name: str, instances: int = 1) -> dict[str, Any]:
    """Start a model again: `instances` kept running (min_instances, default 1), max_instances at least that."""
    if not 0 <= instances <= 64:
        raise InvalidRequest("instances is 0 to 64.", param="instances")
    entry = await model_catalog.start(store(request), name, instances, settings(request).model_file_roots())
    await _catalog(request).refresh()
    return model_catalog.entry_body(entry, _status(request, name))


@admin.delete("/api/models/{name}")
async def remove_model(request: Request, name: str) -> dict[str, Any]:
    """Remove a model: its instances drain, and its requests are answered 404."""
    entry = await model_catalog.remove(store(request), name)
    await _catalog(request).refresh()
    return model_catalog.entry_body(entry)
