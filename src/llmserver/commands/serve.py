"""`llmserver serve`: the gateway and its supervised llama-server instances."""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from llmserver import __version__
from llmserver.commands import (
    check_catalog,
    check_model_files,
    configure_logs,
    debugging,
    load,
    log_level_option,
    models_from_args,
    open_checked_store,
    remember,
    settings_options,
)
from llmserver.settings import Settings
from llmserver.systemd import Notifier

if TYPE_CHECKING:
    from llmserver.server.http_protocol import Limits

log = logging.getLogger(__name__)


@click.command()
@settings_options
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to listen on (default 8000).")
@click.option(
    "--model", "model_specs", multiple=True,
    help="Model to serve: a configured name, SmolLM2-135M-Instruct-Q4_1, or a .gguf path. Repeatable.",
)  # fmt: skip
@log_level_option
@click.option(
    "--role",
    type=click.Choice(["all", "gateway"]),
    default=None,
    expose_value=False,
    callback=remember,
    help="all (default): run its own instances; gateway: route to the instances `llmserver node`s publish.",
)
@click.option(
    "--redis-url", default=None, expose_value=False, callback=remember,
    help="redis://… where rpm and max_concurrency are counted for all gateways (default: $LLMSERVER_STATE__REDIS_URL).",
)  # fmt: skip
@click.option(
    "--workers", type=int, default=None,
    help="Gateway processes on this port (role gateway with PostgreSQL; default 1).",
)  # fmt: skip
def serve(
    config_file: Path | None,
    data_dir: Path | None,
    host: str | None,
    port: int | None,
    model_specs: tuple[str, ...],
    log_level: str | None,
    workers: int | None,
) -> None:
    """Start the gateway and one llama-server per configured model instance."""
    import uvicorn

    from llmserver.app import create_app
    from llmserver.commands.workers import listening_socket, supervise, worker_number
    from llmserver.server.http_protocol import QuietServer, protocol_with

    debug = debugging()  # `llmserver --debug serve`, or LLMSERVER_DEBUG=1
    given = {
        "data_dir": data_dir, "server": {"host": host, "port": port, "workers": workers},
        "observability": {"log_level": "debug" if debug else log_level},
    }  # fmt: skip
    settings = load(config_file, logged=True, **given)
    chosen = models_from_args(model_specs, settings.models)
    if chosen is not None:
        settings = load(config_file, logged=True, **given, models=chosen)
    configure_logs(settings)
    # The database first: a schema to migrate, or a server that cannot be reached, is one clean line.
    open_checked_store(settings)
    if settings.role == "gateway" and not settings.state.redis_url:
        raise click.UsageError(
            "a gateway finds the nodes' instances in Redis: set --redis-url (or LLMSERVER_STATE__REDIS_URL)"
        )
    if settings.role == "all":  # a gateway of role `gateway` runs no model itself
        check_model_files(settings)
    check_catalog(settings)  # the config file's models into the catalog, or why they cannot go there
    number = worker_number()
    if settings.server.workers > 1 and number is None:
        raise SystemExit(supervise(settings))
    if number is not None:  # one of --workers' processes: a gateway of its own
        state = settings.state.model_copy(update={"gateway_id": f"{settings.state.gateway_id}-{number}"})
        settings = settings.model_copy(update={"state": state})
    # What would refuse to start, found before any instance starts: each one line and exit 1 (--debug:
    # its traceback too). The port first: a second gateway on a taken port must not say it is ready.
    listening = listening_socket(settings.server.host, settings.server.port, reuse_port=number is not None)
    check_gateway_id(settings, debug)
    # uvicorn re-raises the signal it stopped on once its shutdown is over; by default that ends the
    # process by the signal, which skips Python's exit handlers (the forkserver's socket folder would
    # stay in TMPDIR) and reports "killed by SIGTERM" to the init system. A finished stop is exit 0.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, _stopped)
    _raise_open_files(settings.server.max_connections + 256)  # and the instances, the store, Redis, logs
    config = uvicorn.Config(
        create_app(settings),
        http=protocol_with(connection_limits(settings)),
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.observability.log_level,
        log_config=None,  # uvicorn's lines go through ours (logs.configure): one format, with times
        access_log=False,  # ours (llmserver.access) leaves out query strings, which may carry keys
        server_header=False,  # no "server: uvicorn" on every answer: nothing a client needs, a banner for probes
        # Nothing here reads the client's address or scheme (the access log names the key): no layer
        # rewriting them from X-Forwarded-* on every request.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.server.drain_timeout),  # in-flight requests get this long
    )
    server = QuietServer(config)
    notifier = Notifier()  # systemd's Type=notify (a worker's: its supervisor's relay)

    def started() -> None:
        log.info(
            "llmserver %s ready on http://%s:%s (gateway %s); web console at /console",
            __version__, settings.server.host, settings.server.port, settings.state.gateway_id,
        )  # fmt: skip
        notifier.ready(f"serving on {settings.server.host}:{settings.server.port}")
        notifier.start_watchdog()

    server.on_started = started
    server.on_exit = notifier.stopping
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listening])
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the app or the socket failed to start


def check_gateway_id(settings: Settings, debug: bool = False) -> None:
    """Exit with one line when another live gateway holds this gateway_id (after waiting for it to
    let go, as the gateway itself would): found before the instances start."""
    import asyncio

    from llmserver.cluster.gateways import GatewayIdInUse, GatewayLease
    from llmserver.store import open_store

    async def check() -> None:
        store = await open_store(settings.state.database_url)
        try:
            lease = GatewayLease(
                store, store, settings.state.gateway_id, lease=settings.state.gateway_lease_seconds,
                job_ttl=settings.jobs.result_ttl, produced=dict,
            )  # fmt: skip
            await lease.check_free()
        finally:
            await store.close()

    try:
        asyncio.run(check())
    except GatewayIdInUse as exc:
        if debug:
            raise
        raise click.ClickException(str(exc)) from None


def connection_limits(settings: Settings) -> Limits:
    """The client connections' limits, from the settings."""
    from llmserver.server.http_protocol import Limits

    return Limits(
        read_timeout=settings.server.request_read_timeout,
        max_header_bytes=settings.server.max_header_bytes,
        max_header_count=settings.server.max_header_count,
        min_body_rate=settings.server.min_request_body_rate,
        max_connections=settings.server.max_connections,
    )


def _raise_open_files(wanted: int) -> None:
    """The soft open-file limit raised towards `wanted` (as far as the hard limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted or soft == resource.RLIM_INFINITY:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning(
            "the open-file limit (%d) is below what max_connections needs (%d): connections beyond it are refused "
            "by the system, not answered 503; raise it (LimitNOFILE=, ulimit -n) or lower max_connections",
            target, wanted,
        )  # fmt: skip


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)
