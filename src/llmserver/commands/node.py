"""`llmserver node`: a worker host's llama-server instances, supervised and published in Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from llmserver.commands import (
    check_model_files,
    configure_logs,
    debugging,
    load,
    log_level_option,
    remember,
    settings_options,
)
from llmserver.settings import is_loopback


@click.command()
@settings_options
@click.option(
    "--redis-url", default=None, expose_value=False, callback=remember,
    help="redis://… where the node publishes its instances (default: $LLMSERVER_STATE__REDIS_URL).",
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
    debug = debugging()  # `llmserver --debug node`, or LLMSERVER_DEBUG=1
    settings = load(
        config_file, logged=True, data_dir=data_dir, instances={"host": advertise}, node={"port": metrics_port},
        observability={"log_level": "debug" if debug else log_level},
    )  # fmt: skip
    if not settings.state.redis_url:
        raise click.UsageError(
            "a node publishes its instances in Redis: set --redis-url (or LLMSERVER_STATE__REDIS_URL)"
        )
    if settings.instances.api_key is None:
        raise click.UsageError(
            f"instances would listen on {settings.instances.host} without a key: set [instances] api_key "
            "(LLMSERVER_INSTANCES__API_KEY), the key gateways use to reach them"
        )
    if (
        not is_loopback(settings.instances.host)
        and settings.instances.tls_cert is None
        and not settings.instances.plain_http
    ):
        raise click.UsageError(
            f"instances on {settings.instances.host} would take the instance key in clear over the network: set "
            "tls_cert and tls_key in [instances] (their HTTPS certificate, which gateways verify with "
            "tls_ca), or plain_http = true there on a private network you trust"
        )
    configure_logs(settings)
    # No [[models]]: the scheduler assigns what this node runs, and it starts with none.
    models = settings.models if settings.models_given else []
    check_model_files(settings, models)
    listening = None
    if settings.node.port:
        from llmserver.commands.workers import listening_socket

        purpose = " for /health, /ready and /metrics (--metrics-port: another, or 0 for none)"
        listening = listening_socket(settings.node.host, settings.node.port, purpose=purpose)
    from llmserver.cluster.node import NodeIdInUse, run_node  # the node's modules, only once it runs

    try:
        asyncio.run(run_node(settings, models, listening))
    except NodeIdInUse as exc:
        if debug:
            raise
        raise click.ClickException(str(exc)) from None
