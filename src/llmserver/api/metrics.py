"""GET /metrics: Prometheus text, for `metrics_token`, admin keys, or anyone with metrics_public.

It answers while the database cannot be reached: `metrics_token` and LLMSERVER_ADMIN_KEY are checked
without it, and an admin key the database confirmed within the last day is taken on trust meanwhile.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserver.api.access import Access, router
from llmserver.api.deps import bearer_token, keys, require_admin, settings
from llmserver.api.deps import metrics as metrics_of
from llmserver.errors import StateUnavailable
from llmserver.health import Readiness

scraped = router(Access.OWN)  # a scrape token, or an admin key checked while the database is down
routers = (scraped,)


@scraped.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    config = settings(request).observability
    if not config.metrics_public:
        presented = bearer_token(request)
        token = config.metrics_token.get_secret_value() if config.metrics_token else None
        if not (token and presented and hmac.compare_digest(presented.encode(), token.encode())):
            try:
                await require_admin(request)
            except StateUnavailable:
                if not keys(request).admin_seen(presented or request.query_params.get("api_key")):
                    raise
    readiness: Readiness = request.app.state.readiness
    await readiness.check()  # the components' states in this scrape: at most a second old
    collected = metrics_of(request)
    if collected.gateway is not None:
        await collected.gateway.refresh()
    return Response(collected.render(), media_type=CONTENT_TYPE_LATEST)
