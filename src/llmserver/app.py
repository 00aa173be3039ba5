"""The app factory: `create_app(settings)` builds every service in the lifespan, onto app.state."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

from llmserver import __version__, console, tracing
from llmserver.api import anthropic, embeddings, health, instances, jobs, keys, metrics, models, native, nodes, openai
from llmserver.api import audit as audit_api
from llmserver.api import responses as responses_api
from llmserver.api import teams as teams_api
from llmserver.api.access import check_routes
from llmserver.api.deps import direct_routes
from llmserver.auth.audit import Audit
from llmserver.auth.keys import KeyService
from llmserver.auth.limiters import MemoryConcurrencyLimiter, open_limiters
from llmserver.auth.quota import QuotaService
from llmserver.auth.revocation import KeyWatch
from llmserver.auth.teams import TeamService
from llmserver.cluster.collector import GatewayCollector
from llmserver.cluster.gateways import GatewayLease
from llmserver.cluster.registry import Registry
from llmserver.cluster.scheduler import Scheduler
from llmserver.engine.calls import InstanceCalls
from llmserver.engine.embeddings import EmbeddingService
from llmserver.engine.generation import GenerationService
from llmserver.errors import ANTHROPIC_PATHS, APIError, StateUnavailable, error_body, for_path, validation_error
from llmserver.health import Probe, Readiness, fresh_probe, models_probe, redis_probe
from llmserver.inputs.documents import DocumentService
from llmserver.inputs.images import ImageService
from llmserver.inputs.prepare import InputService
from llmserver.jobs.runner import JobService
from llmserver.metrics.prometheus import Metrics
from llmserver.metrics.recorder import UsageRecorder
from llmserver.metrics.speed import RollingSpeed
from llmserver.models import catalog as model_catalog
from llmserver.models.lineup import Lineup
from llmserver.pool.admission import Admission
from llmserver.pool.collector import PoolCollector
from llmserver.pool.router import Router
from llmserver.pool.supervisor import Supervisor
from llmserver.server.front import Front
from llmserver.settings import ModelConfig, Settings
from llmserver.store import CatalogEntry, open_store

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_file",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _log_pending_tasks() -> None:
    """The stop is overdue: log every task still pending and where it waits (for a bug report)."""
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    log.error("stopping takes longer than drain_timeout + 15 s; %d tasks are still pending:", len(pending))
    for task in pending:
        stack = io.StringIO()
        task.print_stack(limit=8, file=stack)
        log.error("%s", stack.getvalue().rstrip())


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        tracing.configure(settings.observability.otlp_endpoint, "llmserver")
        store = await open_store(settings.state.database_url)
        try:  # the models: the catalog's, with the config file's brought in (models/catalog.py)
            entries = await model_catalog.seed(store, settings)
        except BaseException:
            await store.close()
            raise
        own = list(settings.models)  # the config file's (a gateway of role `all` on a shared database keeps them)
        lineup = Lineup(model_catalog.served(entries, settings, own))
        gateway = settings.state.gateway_id
        admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
        supervisor = Supervisor(settings, lineup)
        metrics = Metrics(supervisor.pools)
        metrics.registry.register(PoolCollector(supervisor, node=settings.node.id or gateway))
        quota = QuotaService(
            store,
            gateway,
            currency=settings.billing.currency,
            thresholds=tuple(settings.billing.budget_alerts),
            webhook=settings.billing.budget_webhook,
        )
        speed = RollingSpeed(store)
        supervisor.speed_of = speed.average
        await speed.load()
        recorder = UsageRecorder(store, quota, speed, metrics)
        rate, concurrency, shared = open_limiters(settings.state.redis_url, gateway)
        if shared is None and not settings.state.database_url.startswith("sqlite:"):
            log.warning("no redis_url: rpm and max_concurrency are counted per gateway, not for all gateways at once")
        admission = Admission(
            Router(supervisor.pools),
            rate,
            concurrency,
            quota,
            recorder,
            metrics,
            default_concurrency=settings.limits.max_concurrency_per_key,
            local_concurrency=MemoryConcurrencyLimiter() if shared is not None else None,
        )

        async def refresh_speed() -> None:
            await recorder.flush()
            await speed.refresh()

        key_service = KeyService(store, admin_key, settings.state.key_cache_seconds)
        key_watch = app.state.key_watch = KeyWatch(store, settings.state.key_cache_seconds)
        app.state.teams = TeamService(store, key_service)

        async def use_models(catalog_entries: list[CatalogEntry]) -> None:
            models = model_catalog.served(catalog_entries, settings, own)
            await supervisor.apply(models)
            app.state.generation.use_models(models)
            app.state.embeddings.use_models(models)
            inputs.vision_models = {model.name for model in models if model.vision_capable}

        catalog = app.state.catalog = model_catalog.CatalogFollower(store, use_models)
        # The gateway's periodic store work, all in its heartbeat: one wake-up every 2 s, not one per task.
        lease = GatewayLease(
            store,
            store,
            gateway,
            lease=settings.state.gateway_lease_seconds,
            job_ttl=settings.jobs.result_ttl,
            produced=recorder.produced,
            on_beat=[
                refresh_speed,
                key_service.flush_used,
                catalog.follow,
                *([shared.resync] if shared is not None else []),
            ],
            on_sweep=shared.forget_gateway if shared is not None else None,
        )
        documents = DocumentService(
            timeout=settings.limits.files.extract_timeout,
            memory_mb=settings.limits.files.extract_memory_mb,
            limits=settings.limits.files,
            workers=settings.limits.files.extract_workers or None,
            on_extraction=metrics.extracted,
        )
        documents.warm_up()
        images = ImageService(
            timeout=settings.limits.images.fetch_timeout,
            limits=settings.limits.images,
            allow_hosts=settings.limits.images.fetch_allow_hosts,
            on_prepared=lambda source, seconds: metrics.image_seconds.labels(source).observe(seconds),
        )
        inputs = InputService(images, documents, [m.name for m in lineup if m.vision_capable])
        calls = InstanceCalls(
            admission,
            attempts=settings.instances.attempts,
            timeout=settings.limits.request_timeout,
            isolate_keys=settings.prompt_cache.isolation == "key",
        )
        job_service = JobService(settings, store, store, store, store)
        job_service.key_watch = key_watch
        recorder.on_alert = job_service.outbox.wake  # a budget alert's webhook, queued by a settlement

        app.state.settings = settings
        app.state.store = store
        app.state.keys = key_service
        app.state.audit = Audit(store, frozenset(ModelConfig.model_fields), on_recorded=_counted(metrics))
        app.state.supervisor = supervisor
        app.state.metrics = metrics
        app.state.quota = quota
        app.state.speed = speed
        app.state.recorder = recorder
        app.state.generation = GenerationService(settings, admission, inputs, calls, recorder, lineup.models, key_watch)
        app.state.embeddings = EmbeddingService(settings, admission, calls, lineup.models)
        app.state.lineup = lineup
        app.state.jobs = job_service
        app.state.started_at = time.time()
        registry = app.state.registry = supervisor.remote = _registry(settings, supervisor)
        scheduler = None
        if registry is not None:
            supervisor.on_new_pool = registry.adopt
            scheduler = Scheduler(
                store, registry.client, gateway, catalog, lease_seconds=settings.state.scheduler_lease_seconds
            )
        probes: dict[str, Probe] = {"database": store.ping}
        if shared is not None:
            probes["redis"] = redis_probe(shared.client)
        live: dict[str, Probe] = {}
        if registry is not None:
            live["registry"] = fresh_probe("the instance registry was last read", lambda: registry.read_at)
        live["models"] = models_probe(supervisor.pools, settings.server.ready_models)
        app.state.readiness = Readiness(probes, live)
        metrics.registry.register(app.state.readiness)
        metrics.gateway = GatewayCollector(lease, job_service, registry)
        metrics.registry.register(metrics.gateway)
        try:
            await lease.start()
            await job_service.start()
            await supervisor.start()
            if registry is not None:
                await registry.start()
            catalog.start(entries)
            key_watch.start()
            if scheduler is not None:
                scheduler.start()
            # What startup built (routes, schemas, models) lives as long as the process: out of the
            # collector's way, so that collections under load walk only what requests allocate. And
            # the youngest generation is collected every 20,000 allocations, not every 700: a tiny
            # request allocates a few thousand objects, nearly all freed by reference counting (0.1 ms
            # less CPU a request, measured).
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
            log.info("started: %d models, gateway %s", len(supervisor.pools), gateway)
            yield
        finally:
            # Should a step below hang, say where: the tasks still waiting, with their stacks.
            overdue = asyncio.get_running_loop().call_later(settings.server.drain_timeout + 15, _log_pending_tasks)
            if scheduler is not None:
                await scheduler.stop()
            await catalog.stop()
            await key_watch.stop()
            await job_service.stop(grace=settings.server.drain_timeout)
            if registry is not None:
                await registry.stop()
            await supervisor.stop()
            try:
                await recorder.flush()
            except APIError as exc:
                log.error("usage rows and settlements could not be written before stopping: %s", exc.message)
            await app.state.audit.flush()  # the rows of the last admin actions, written after their answers
            await lease.stop()
            if shared is not None:
                await shared.close()
            await store.close()
            documents.close()
            tracing.shutdown()
            overdue.cancel()

    # No /docs: Swagger UI loads from a CDN, blank on a machine without internet; /openapi.json stays.
    # FastAPI's native OpenTelemetry is off: with no provider configured it still asked for one on every
    # request (a dozen calls each); the server's metrics are Prometheus's, at /metrics.
    app = Gateway(
        title="llmserver", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )  # fmt: skip
    modules = (
        native,
        openai,
        responses_api,
        anthropic,
        embeddings,
        models,
        jobs,
        instances,
        nodes,
        keys,
        teams_api,
        audit_api,
        metrics,
        health,
    )
    routers = [router for module in modules for router in module.routers]
    for router in routers:
        app.include_router(router)
    console.install(app)
    check_routes(app)
    _install_error_handlers(app)
    app.front = lambda stack, hot: Front(
        stack,
        max_bytes=settings.server.max_request_bytes,
        quota=lambda: app.state.quota,
        audit=lambda: app.state.audit,
        hot=hot,
        api_error=_api_error,
        unexpected=_unexpected,
    )
    return app


def _counted(metrics: Metrics) -> Callable[[str, int], None]:
    """An audited admin action's metric: counted when it went through."""

    def count(action: str, status: int) -> None:
        if status < 400:
            metrics.admin_actions.labels(action).inc()

    return count


class Gateway(FastAPI):
    """The app under its `front` (`server/front.Front`: outermost, beyond Starlette's error middleware).

    The front calls the generation endpoints marked `direct` itself (`api/deps.direct_routes`), as
    FastAPI would and with its error handlers, for those FastAPI would run nothing else for: built with
    the stack, once every route and middleware is in, so that a dependency on such a route, or any
    middleware added to the app, sends its requests through FastAPI like every other."""

    front: Callable[[ASGIApp, Mapping[str, Callable[[Request], Awaitable[Response]]]], ASGIApp] | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        if self.front is None:
            return stack
        return self.front(stack, {} if self.user_middleware else direct_routes(self.routes))


def _registry(settings: Settings, supervisor: Supervisor) -> Registry | None:
    """For a gateway of role `gateway`: the instances the nodes publish in Redis."""
    if supervisor.local:
        return None
    from llmserver.auth.limiters import connect_redis

    client = connect_redis(settings.state.redis_url)
    return Registry(
        client,
        supervisor.pools,
        settings.instances.key,
        settings.state.gateway_id,
        settings.instances.tls(),
        saved=supervisor.saved_prompts,  # the per-key tier's counters, for nodes' instances too
        min_tokens=settings.prompt_cache.min_tokens,
    )


GC_YOUNG_THRESHOLD = 20_000

GENERATING = (
    "/api/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/input_tokens",
    *ANTHROPIC_PATHS,
)


def _record_refusal(request: Request, outcome: str) -> None:
    """Every generating request with a valid key is a ledger row: one refused before it held a ticket
    (bad body, limits, quota) too, with the error type as its outcome. Not one refused because the shared
    state could not be read (StateUnavailable): that is not accepted, whether its key was looked up
    before the database went away or not."""
    principal = getattr(request.state, "principal", None)
    if principal is None or getattr(request.state, "tally", None) is not None or request.url.path not in GENERATING:
        return
    model = getattr(request.state, "model", None) or request.app.state.lineup.models[0].name
    request.app.state.recorder.refused(principal, request.url.path, str(model)[:128], outcome)


def _note_error(request: Request, type_: str, message: str) -> None:
    """The error an answer carries, for its access line (server/front.py: JSON logs' error_type/_message)."""
    request.state.error = (type_, message)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    _note_error(request, exc.type, exc.message)
    if not isinstance(exc, StateUnavailable):
        _record_refusal(request, exc.type)
    app = request.scope.get("app")
    if exc.status != 499 and app is not None and (metrics := getattr(app.state, "metrics", None)) is not None:
        metrics.refusals.labels(exc.reason or exc.type).inc()
    return JSONResponse(exc.body_for(request.url.path), status_code=exc.status, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    _note_error(request, "server_error", "Internal server error")
    return JSONResponse(for_path(request.url.path, error_body(500, "server_error", "Internal server error")), 500)


def _install_error_handlers(app: FastAPI) -> None:
    async def request_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc.errors())
        _note_error(request, error.type, error.message)
        _record_refusal(request, error.type)
        return JSONResponse(for_path(request.url.path, error.body()), status_code=error.status)

    async def http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"No such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = _STATUS_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        _note_error(request, type_, message)
        body = for_path(request.url.path, error_body(exc.status_code, type_, message))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_exception)
    app.add_exception_handler(Exception, _unexpected)
