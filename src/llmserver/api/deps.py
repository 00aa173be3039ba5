"""What every router needs: the services on app.state, the caller's key, the parsed body.

Bodies are parsed here rather than by FastAPI so that the cheap checks run in order: the body size
(middleware), then the key, then validation of the fields.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

import fastapi.routing
import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.routing import BaseRoute

from llmserver.asgi_ext import CANCEL_ON_DISCONNECT, CANCELLED, HEADER_INDEX
from llmserver.auth.audit import Audit
from llmserver.auth.keys import KeyService, Principal
from llmserver.auth.quota import QuotaService
from llmserver.auth.teams import TeamService
from llmserver.engine.embeddings import EmbeddingService
from llmserver.engine.generation import GenerationService
from llmserver.errors import APIError, ClientClosedRequest, InvalidRequest, PermissionDenied, validation_error
from llmserver.jobs.runner import JobService
from llmserver.metrics.prometheus import Metrics
from llmserver.metrics.recorder import UsageRecorder
from llmserver.metrics.speed import RollingSpeed
from llmserver.models.lineup import Lineup
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import Settings
from llmserver.store import Store

Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")


Endpoint = TypeVar("Endpoint", bound=Callable[..., Awaitable[Response]])


def direct(endpoint: Endpoint) -> Endpoint:
    """Marks a POST endpoint that takes the Request alone and reads its own body: `server/front.Front`
    calls it straight from FastAPI's route table (`direct_routes`), past Starlette's routing and
    exception middleware, with the app's own error handlers — as long as FastAPI would run nothing else
    for it: a dependency given to the route, its router or the app takes it off that lane."""
    endpoint.direct = True  # type: ignore[attr-defined]
    return endpoint


def direct_routes(routes: Sequence[BaseRoute]) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """path → endpoint, for the POST routes marked `direct` that have no dependency, as FastAPI resolves
    each route of the app (`routes`: the app's own; FastAPI 0.16x nests included routers' routes in
    objects of its own, which `iter_route_contexts` opens)."""
    contexts: Iterable[Any] = (
        fastapi.routing.iter_route_contexts(routes) if hasattr(fastapi.routing, "iter_route_contexts") else routes
    )
    lane: dict[str, Callable[[Request], Awaitable[Response]]] = {}
    for route in contexts:
        endpoint, dependant = getattr(route, "endpoint", None), getattr(route, "dependant", None)
        if (
            endpoint is not None
            and getattr(endpoint, "direct", False)
            and "POST" in (getattr(route, "methods", None) or ())
            and dependant is not None
            and not dependant.dependencies
        ):
            lane.setdefault(route.path, endpoint)
    return lane


def settings(request: Request) -> Settings:
    value: Settings = request.app.state.settings
    return value


def lineup(request: Request) -> Lineup:
    """The models served now (models/lineup.py): what the settings configured, changed by the catalog."""
    value: Lineup = request.app.state.lineup
    return value


def audit(request: Request) -> Audit:
    value: Audit = request.app.state.audit
    return value


def keys(request: Request) -> KeyService:
    value: KeyService = request.app.state.keys
    return value


def teams(request: Request) -> TeamService:
    value: TeamService = request.app.state.teams
    return value


def generation(request: Request) -> GenerationService:
    value: GenerationService = request.app.state.generation
    return value


def embeddings(request: Request) -> EmbeddingService:
    value: EmbeddingService = request.app.state.embeddings
    return value


def quota(request: Request) -> QuotaService:
    value: QuotaService = request.app.state.quota
    return value


def recorder(request: Request) -> UsageRecorder:
    value: UsageRecorder = request.app.state.recorder
    return value


def metrics(request: Request) -> Metrics:
    value: Metrics = request.app.state.metrics
    return value


def speed(request: Request) -> RollingSpeed:
    value: RollingSpeed = request.app.state.speed
    return value


def store(request: Request) -> Store:
    value: Store = request.app.state.store
    return value


def jobs(request: Request) -> JobService:
    value: JobService = request.app.state.jobs
    return value


def supervisor(request: Request) -> Supervisor:
    value: Supervisor = request.app.state.supervisor
    return value


MAX_PAGE = 500  # rows a page of the request log or the audit log may ask for


def check_page(limit: int, before: int | None) -> None:
    """A paged log's `limit` (1 to MAX_PAGE) and `before` (a row's id from a previous page)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}.", param="limit")
    if before is not None and not 1 <= before < 2**63:
        raise InvalidRequest("before must be a row's id from a previous page (1 or more).", param="before")


def scope_header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    """The first value of a request header (`name` in lower case, as ASGI gives them), straight from
    the scope: Starlette's `Headers` builds a case-insensitive mapping and takes three Python calls a read.
    The headers by name are made once a request (`asgi_ext.HEADER_INDEX`), by the server or here."""
    return _header_index(scope).get(name)


def _header_index(scope: MutableMapping[str, Any]) -> dict[bytes, bytes]:
    headers = scope["headers"]
    index = scope.get(HEADER_INDEX)
    if index is None or index[0] is not headers:  # another server, or headers a layer replaced
        index = scope[HEADER_INDEX] = (headers, dict(reversed(headers)))  # reversed: the first value wins
    return index[1]


def note(request: Request, name: str, value: object) -> None:
    """What `request.state.<name> = value` does (Starlette's State writes to the scope's "state" dict),
    in one step: the State object costs four Python calls a write, and a generation request makes three."""
    request.scope.setdefault("state", {})[name] = value


def header(request: Request, name: bytes) -> str | None:
    value = scope_header(request.scope, name)
    return None if value is None else value.decode("latin-1")


def bearer_token(request: Request) -> str | None:
    return _bearer(scope_header(request.scope, b"authorization"))


def _bearer(authorization: bytes | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header's value."""
    if authorization:
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and (token := token.strip()):
            return token
    return None


def header_key(request: Request) -> str | None:
    """The key sent in a header: `Authorization: Bearer`, else `x-api-key` (Anthropic's SDK and clients)."""
    index = _header_index(request.scope)
    api_key = index.get(b"x-api-key")
    return _bearer(index.get(b"authorization")) or (api_key.decode("latin-1") if api_key else None)


async def authenticate(request: Request, body: dict[str, Any] | None = None) -> Principal:
    """The caller, from `Authorization: Bearer` (or `x-api-key`), else `api_key` in the body, else in the
    query."""
    presented = header_key(request)
    if presented is None and body is not None and isinstance(body.get("api_key"), str):
        presented = body["api_key"]
    if presented is None:
        presented = request.query_params.get("api_key")
    principal = await keys(request).authenticate(presented)
    note(request, "principal", principal)
    return principal


async def json_body(request: Request) -> dict[str, Any]:
    # The Content-Type is not checked: `curl -d` labels JSON as a form, and refusing it helps no one.
    body = parse_json(await read_body(request))
    if isinstance(body.get("model"), str):
        note(request, "model", body["model"])  # for the ledger row of a request refused later
    return body


async def read_body(request: Request) -> bytes:
    """The whole body, from the ASGI messages themselves: Starlette's `Request.body()` reads them
    through an async generator, a few times the cost of this loop (measured: 0.02 ms a request)."""
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            # The client went away, or its body stopped arriving (request_read_timeout): nobody to answer.
            raise ClientClosedRequest("The client closed the connection before sending its whole body.")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = raw  # where Starlette's `body()` keeps it, should anything ask again
    return raw


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object of Unicode text, or InvalidRequest (fuzzed: fuzz/harnesses.py).

    orjson reads nearly every body, several times faster than json. What it refuses, or might read
    otherwise (an integer of 19 digits or more, which may not fit in 64 bits and which orjson would
    turn into a float), is read again by json, whose answer and errors are the reference: NaN, a
    byte order mark, UTF-16, a lone surrogate (orjson refuses every one), bad JSON."""
    if LONG_INTEGER.search(raw) is None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if isinstance(body, dict):
                return body
    try:
        body = json.loads(raw, parse_int=_integer) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("The request body nests arrays or objects too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if TOO_LONG_INTEGER.search(raw):
        where = path_of(body, lambda value: isinstance(value, _TooLong))
        if where is not None:
            raise InvalidRequest(
                f"{where or 'body'}: an integer literal of more than {INTEGER_DIGITS} digits; no parameter takes one",
                param=where or None,
            )
    if SURROGATE_ESCAPE.search(raw):  # only then can a string hold a lone surrogate: look for one
        where = lone_surrogate(body)
        if where is not None:
            raise InvalidRequest(
                f"{where or 'body'}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not Unicode text",
                param=where or None,
            )
    return body


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
LONG_INTEGER = re.compile(rb"[0-9]{19}")
# Python converts integer literals of up to this many digits (sys.get_int_max_str_digits); json raises
# ValueError beyond, so they are read as `_TooLong` and refused naming their place.
INTEGER_DIGITS = 4300
TOO_LONG_INTEGER = re.compile(rb"[0-9]{%d}" % (INTEGER_DIGITS + 1))


class _TooLong:
    __slots__ = ()


def _integer(text: str) -> int | _TooLong:
    return int(text) if len(text) <= INTEGER_DIGITS else _TooLong()


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string holding a lone surrogate, if any ("" for the top)."""
    return path_of(value, _unencodable, path)


def _unencodable(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def path_of(value: Any, found: Callable[[Any], bool], path: str = "") -> str | None:
    """The dotted path of the first value (or object key) for which `found` is true ("" for the top)."""
    if found(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and found(key):
            return f"{path}.{key!r}".lstrip(".")
        inner = path_of(item, found, f"{path}.{key}".lstrip("."))
        if inner is not None:
            return inner
    return None


def validate(model: type[Model], body: dict[str, Any]) -> Model:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


# Bodies larger than this are not read before a key in the header or query string has been
# checked against its limits (`gate`): parsing 100 MB of JSON takes 0.2 s.
GATE_BYTES = 1024 * 1024


async def parse(
    request: Request, model: type[Model], gate: Callable[[Principal], Awaitable[None]] | None = None
) -> tuple[Principal, Model]:
    """Authenticate, then validate the JSON body as `model`: a bad key is a 401 whatever the body.

    With a `gate` and a large body, a key sent outside the body is authenticated and gated before
    the body is read: a refusal answers at once (uvicorn discards what the client still sends; curl
    stops sending when it sees the answer, a client that sent `Expect: 100-continue` sends nothing)."""
    principal: Principal | None = None
    if gate is not None and _large(request) and (header_key(request) or request.query_params.get("api_key")):
        principal = await authenticate(request)
        await gate(principal)
    principal, body = await _keyed_body(request, principal)
    return principal, validate(model, body)


async def _keyed_body(request: Request, principal: Principal | None = None) -> tuple[Principal, dict[str, Any]]:
    """The caller (unless already known) and the JSON body: a bad key is a 401 whatever the body, so the
    body's problem is raised only once the key (which may travel in it) has been checked."""
    try:
        body: dict[str, Any] | None = await json_body(request)
        problem: APIError | None = None
    except APIError as exc:
        body, problem = None, exc
    if principal is None:
        principal = await authenticate(request, body)
    if problem is not None or body is None:
        raise problem or InvalidRequest("The request body must be a JSON object.")
    return principal, body


def _large(request: Request) -> bool:
    length = header(request, b"content-length")
    return not length or not length.isdigit() or int(length) > GATE_BYTES


async def require_admin(request: Request) -> Principal:
    principal = await authenticate(request)
    if not principal.is_admin:
        raise PermissionDenied("This endpoint needs an admin key.")
    return principal


async def cancel_on_disconnect(request: Request, work: Awaitable[T], after: float = 0.05) -> T:
    """Await `work` in this task, but cancel it if the client goes away first.

    Cancelling closes the connection to llama-server, which stops generating and frees the slot:
    without this, a non-streamed request would run to the end for nobody. llmserver's own server
    (`http_protocol`) cancels the task itself when the connection is lost, at no cost per request;
    under another server a watcher (a task waiting for the disconnect) starts once `work` has taken
    `after` seconds: for a quick answer it would cost more than the answer's own work.
    """
    scope = request.scope
    if CANCEL_ON_DISCONNECT not in scope:
        return await _watched(request, work, after)
    scope[CANCEL_ON_DISCONNECT] = True
    try:
        return await work
    except asyncio.CancelledError:
        if scope[CANCEL_ON_DISCONNECT] == CANCELLED:
            _uncancel()
            raise _client_closed() from None
        raise
    finally:
        if scope[CANCEL_ON_DISCONNECT] is True:  # in the step that ends `work`: no cancelling it after
            scope[CANCEL_ON_DISCONNECT] = False


def _uncancel() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.uncancel()


def _client_closed() -> ClientClosedRequest:
    return ClientClosedRequest("The client closed the connection before the answer was ready.")


async def _watched(request: Request, work: Awaitable[T], after: float) -> T:
    current = asyncio.current_task()
    assert current is not None
    loop = asyncio.get_running_loop()
    watcher: asyncio.Task[None] | None = None
    finished = gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not finished:
            gone = True
            current.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(after, start_watching)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise _client_closed() from None
        raise
    finally:
        finished = True  # in the step that ends `work`: the watcher can no longer cancel this task
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


class FastJSONResponse(Response):
    """JSON written by orjson: a generation's answer, several times faster to render than json's; its
    headers built in one step (`headers` are extra ones, never Content-Type or Content-Length)."""

    media_type = "application/json"

    def __init__(
        self,
        content: Any = None,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        # Starlette's steps (`render`, `init_headers`) in one: every JSON answer is made here.
        self.status_code = status_code
        if media_type is not None:
            self.media_type = media_type
        self.background = background
        self.body = orjson.dumps(content)
        self.raw_headers = [
            (b"content-type", self.media_type.encode("latin-1")), (b"content-length", b"%d" % len(self.body))
        ]  # fmt: skip
        if headers:
            self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` that documents a JSON body parsed by `parse` (so that clients and fuzzers see it),
    with pydantic's `$defs` inlined: they do not resolve inside an OpenAPI document."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(definitions[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
