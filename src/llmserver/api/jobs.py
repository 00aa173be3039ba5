"""GET /api/async_result: poll an async job. A ready result is handed out exactly once."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from llmserver.api.access import Access, caller, router
from llmserver.api.deps import jobs
from llmserver.errors import InvalidRequest
from llmserver.store import JobRecord

keyed = router(Access.KEY)
routers = (keyed,)


class _OnceResponse(JSONResponse):
    """Deletes the claimed job only once the answer went out; makes it pollable again otherwise."""

    def __init__(self, content: object, request: Request, job: JobRecord) -> None:
        super().__init__(content)
        self._request = request
        self._job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = jobs(self._request)
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            await service.undelivered(self._job)
            raise
        # Handed to the server's transport: as delivered as HTTP can tell. (Asking is_disconnected()
        # now would race the client's own close after reading.)
        await service.delivered(self._job)


@keyed.get("/api/async_result", response_model=None)
async def async_result(request: Request, tracking_id: str | None = None) -> JSONResponse:
    principal = caller(request)
    if not tracking_id:
        raise InvalidRequest("tracking_id: Field required", param="tracking_id")
    answer, claimed = await jobs(request).poll(principal, tracking_id)
    if claimed is None:
        return JSONResponse(answer)
    return _OnceResponse(answer, request, claimed)
