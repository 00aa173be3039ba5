"""The node API (admin keys only): the worker nodes, and the operator's marks on them (cluster/nodes.py)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from llmserver.api.access import Access, router
from llmserver.api.deps import store
from llmserver.cluster import nodes
from llmserver.cluster.registry import Registry
from llmserver.errors import NotFound

admin = router(Access.ADMIN)
routers = (admin,)


def _registry(request: Request) -> Registry | None:
    registry: Registry | None = request.app.state.registry
    return registry


@admin.get("/api/nodes")
async def list_nodes(request: Request) -> dict[str, Any]:
    """Every worker node that publishes or carries a mark (none on a server that runs its instances itself)."""
    registry = _registry(request)
    data = await nodes.describe(registry.client, store(request)) if registry is not None else []
    return {"object": "list", "data": data}


@admin.post("/api/nodes/{node}/{action}")
async def mark_node(request: Request, node: str, action: str) -> dict[str, Any]:
    """`cordon` (no new placements), `drain` (and its instances move to other nodes), `uncordon`."""
    registry = _registry(request)
    if registry is None:
        raise NotFound("This server runs its instances itself: it has no worker nodes.", param="node")
    return await nodes.mark(registry.client, store(request), node, action)
