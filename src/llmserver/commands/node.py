"""`llmserver node`: a worker host's llama-server instances, supervised and published in Redis."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path

import click

from llmserver.commands import check_model_files, load, remember, settings_options
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
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
def node(config_file: Path | None, data_dir: Path | None, advertise: str | None, log_level: str | None) -> None:
    """Run this host's instances of the configured models for the gateways (`serve --role gateway`)."""
    overrides = {"instance_host": advertise} if advertise else {}
    settings = load(config_file, data_dir=data_dir, log_level=log_level, **overrides)
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
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_model_files(settings)
    asyncio.run(_run(settings))


async def _run(settings: Settings) -> None:
    from llmserver.auth.limiters import connect_redis
    from llmserver.pool.registry import Publisher
    from llmserver.pool.supervisor import Supervisor

    log = logging.getLogger("llmserver.node")
    node_id = settings.node_id or socket.gethostname()
    supervisor = Supervisor(settings)
    client = connect_redis(settings.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(stop_signal, stop.set)
    await supervisor.start()
    publisher = Publisher(client, supervisor, node_id)
    publishing = asyncio.create_task(publisher.run(), name="publish")
    commands = asyncio.create_task(publisher.serve_commands(), name="node-commands")
    log.info(
        "node %s (incarnation %s) publishes %d instances on %s",
        node_id, publisher.incarnation, len(supervisor.all_instances()), settings.instance_host,
    )  # fmt: skip
    try:
        await stop.wait()
    finally:
        publishing.cancel()
        commands.cancel()
        await publisher.withdraw()
        await supervisor.stop()
        await client.aclose()
        log.info("node %s stopped", node_id)
