"""`llmserver node`: a worker host's llama-server instances, supervised and published in Redis."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path

import click

from llmserver import logs
from llmserver.commands import check_model_files, load, log_level_option, remember, settings_options
from llmserver.settings import Settings, is_loopback


@click.command()
@settings_options
@click.option(
    "--redis-url", default=None, expose_value=False, callback=remember,
    help="redis://… where the node publishes its instances (default: $LLMSERVER_REDIS_URL).",
)  # fmt: skip
@click.option(
    "--advertise", default=None, help="The address gateways reach this host's instances at (they bind to it)."
)
@click.option(
    "--metrics-port", type=int, default=None,
    help="Port of the node's /health, /ready and /metrics (default 8081; 0: none).",
)  # fmt: skip
@log_level_option
def node(
    config_file: Path | None,
    data_dir: Path | None,
    advertise: str | None,
    metrics_port: int | None,
    log_level: str | None,
) -> None:
    """Run this host's instances of the configured models for the gateways (`serve --role gateway`)."""
    from llmserver.cli import debugging

    debug = debugging()  # `llmserver --debug node`, or LLMSERVER_DEBUG=1
    overrides: dict[str, object] = {"instance_host": advertise} if advertise else {}
    if metrics_port is not None:
        overrides["node_port"] = metrics_port
    settings = load(config_file, data_dir=data_dir, log_level="debug" if debug else log_level, **overrides)
    if not settings.redis_url:
        raise click.UsageError("a node publishes its instances in Redis: set --redis-url (or LLMSERVER_REDIS_URL)")
    if settings.instance_api_key is None:
        raise click.UsageError(
            f"instances would listen on {settings.instance_host} without a key: set instance_api_key "
            "(LLMSERVER_INSTANCE_API_KEY), the key gateways use to reach them"
        )
    if (
        not is_loopback(settings.instance_host)
        and settings.instance_tls_cert is None
        and not settings.instance_plain_http
    ):
        raise click.UsageError(
            f"instances on {settings.instance_host} would take the instance key in clear over the network: set "
            "instance_tls_cert and instance_tls_key (their HTTPS certificate, which gateways verify with "
            "instance_tls_ca), or instance_plain_http = true on a private network you trust"
        )
    logs.configure(settings.log_level, settings.log_format)
    if not settings._models_given:  # no [[models]]: the scheduler assigns what this node runs
        settings.models = []
    check_model_files(settings)
    listening = None
    if settings.node_port:
        from llmserver.commands.workers import listening_socket

        purpose = " for /health, /ready and /metrics (--metrics-port: another, or 0 for none)"
        listening = listening_socket(settings.node_http_host, settings.node_port, purpose=purpose)
    asyncio.run(_run(settings, listening))


async def _run(settings: Settings, listening: socket.socket | None) -> None:
    import uvicorn

    from llmserver.auth.limiters import connect_redis
    from llmserver.cluster.assignments import Assignments
    from llmserver.cluster.node_http import NodeServer, node_app
    from llmserver.cluster.registry import NodeIdInUse, Publisher
    from llmserver.health import Probe, Readiness, fresh_probe, models_probe, redis_probe
    from llmserver.metrics.prometheus import Metrics
    from llmserver.pool.supervisor import Supervisor
    from llmserver.systemd import Notifier

    log = logging.getLogger("llmserver.node")
    node_id = settings.node_id or socket.gethostname()
    supervisor = Supervisor(settings)
    client = connect_redis(settings.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(stop_signal, stop.set)
    publisher = Publisher(client, supervisor, node_id)
    supervisor.drain_wait = publisher.settle  # a drain waits for the gateways' requests on the instance
    assignments = Assignments(client, supervisor, settings, node_id) if not settings.models else None
    if assignments is not None:
        publisher.extra, publisher.scheduled = assignments.record, True
    live: dict[str, Probe] = {
        "publishing": fresh_probe("the instances were last published", lambda: publisher.published_at),
        "models": models_probe(supervisor.pools),
    }
    readiness = Readiness({"redis": redis_probe(client)}, live)
    metrics = Metrics(supervisor, node=node_id)
    metrics.registry.register(readiness)
    http: NodeServer | None = None
    serving: asyncio.Task[None] | None = None
    if listening is not None:
        http = NodeServer(
            uvicorn.Config(
                node_app(settings, supervisor, readiness, metrics),
                log_config=None, access_log=False, lifespan="off", server_header=False,
                log_level=settings.log_level,
            )
        )  # fmt: skip
        serving = asyncio.create_task(http.serve(sockets=[listening]), name="node-http")
    try:
        await publisher.claim()  # before any instance starts: a duplicate node id costs nothing
    except NodeIdInUse as exc:
        if http is not None and serving is not None:
            http.should_exit = True
            await serving
        await client.aclose()
        from llmserver.cli import debugging  # the CLI imports this module

        if debugging():
            raise
        raise click.ClickException(str(exc)) from None
    # Published from now on (none ready yet): the claim is renewed while the instances start.
    publishing = asyncio.create_task(publisher.run(), name="publish")
    await supervisor.start()
    commands = asyncio.create_task(publisher.serve_commands(), name="node-commands")
    assigned = asyncio.create_task(assignments.run(), name="assignments") if assignments is not None else None
    log.info(
        "node %s (incarnation %s) publishes %s on %s%s",
        node_id, publisher.incarnation,
        f"{len(supervisor.all_instances())} instances" if assignments is None
        else "the instances the scheduler assigns it (no [[models]] in its config)",
        settings.instance_host,
        f"; /health, /ready and /metrics on http://{settings.node_http_host}:{settings.node_port}"
        if listening is not None else "",
    )  # fmt: skip
    await publisher.publish()  # its instances in the registry now, before it says it is ready
    notifier = Notifier()
    notifier.ready(f"node {node_id}: {len(supervisor.all_instances())} instances published")
    notifier.start_watchdog()
    try:
        await stop.wait()
    finally:
        notifier.stopping()
        await notifier.stop_watchdog()
        publishing.cancel()
        commands.cancel()
        if assigned is not None:
            assigned.cancel()
        if http is not None and serving is not None:
            http.should_exit = True
            await serving
        await publisher.withdraw()
        await supervisor.stop()
        await client.aclose()
        log.info("node %s stopped", node_id)
