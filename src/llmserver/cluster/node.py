"""A worker host's run loop (`llmserver node`): its supervisor's instances published in Redis, the
gateways' commands served, the scheduler's assignments followed, /health, /ready and /metrics answered."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import TYPE_CHECKING

import uvicorn

from llmserver.auth.limiters import connect_redis
from llmserver.cluster.assignments import Assignments
from llmserver.cluster.node_http import NodeServer, node_app
from llmserver.cluster.publisher import NodeIdInUse, Publisher
from llmserver.cluster.slots import save_on_node, sweep_superseded
from llmserver.health import Probe, Readiness, fresh_probe, models_probe, redis_probe
from llmserver.metrics.prometheus import Metrics
from llmserver.models.lineup import Lineup
from llmserver.pool.collector import PoolCollector
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import ModelConfig, Settings, is_loopback
from llmserver.systemd import Notifier

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["NodeIdInUse", "run_node"]

log = logging.getLogger("llmserver.node")


async def run_node(settings: Settings, models: list[ModelConfig], listening: socket.socket | None) -> None:
    """Start this host's instances of `models` (none: it runs what the scheduler assigns it), publish
    them until SIGTERM or SIGINT, then withdraw them and stop."""
    node_id = settings.node.id or socket.gethostname()
    supervisor = Supervisor(settings, Lineup(models))
    client = connect_redis(settings.state.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(stop_signal, stop.set)
    publisher = Publisher(client, supervisor, node_id)
    publisher.listener = listener_url(settings, listening)
    supervisor.drain_wait = publisher.settle  # a drain waits for the gateways' requests on the instance
    supervisor.on_stall = publisher.stalled  # the gateways learn why their requests on it were dropped
    if (saved := supervisor.saved_prompts) is not None:  # whose conversation each slot holds: in Redis
        supervisor.save_prompts = lambda instance: save_on_node(client, node_id, saved, instance)
    assignments = Assignments(client, supervisor, settings, node_id) if not models else None
    if assignments is not None:
        publisher.extra, publisher.scheduled, publisher.on_release = assignments.record, True, assignments.release
        supervisor.models_move = True  # a model that leaves this node goes on elsewhere: its conversations too
    live: dict[str, Probe] = {
        "publishing": fresh_probe("the instances were last published", lambda: publisher.published_at),
        "models": models_probe(supervisor.pools),
    }
    readiness = Readiness({"redis": redis_probe(client)}, live)
    metrics = Metrics(supervisor.pools)
    metrics.registry.register(PoolCollector(supervisor, node=node_id))
    metrics.registry.register(readiness)
    http: NodeServer | None = None
    serving: asyncio.Task[None] | None = None
    if listening is not None:
        http = NodeServer(
            uvicorn.Config(
                node_app(settings, supervisor, readiness, metrics),
                log_config=None, access_log=False, lifespan="off", server_header=False,
                log_level=settings.observability.log_level,
            )
        )  # fmt: skip
        serving = asyncio.create_task(http.serve(sockets=[listening]), name="node-http")
    try:
        await publisher.claim()  # before any instance starts: a duplicate node id costs nothing
    except NodeIdInUse:
        if http is not None and serving is not None:
            http.should_exit = True
            await serving
        await client.aclose()
        raise
    # Published from now on (none ready yet): the claim is renewed while the instances start.
    publishing = asyncio.create_task(publisher.run(), name="publish")
    await supervisor.start()
    commands = asyncio.create_task(publisher.serve_commands(), name="node-commands")
    trimming = asyncio.create_task(_trim_saved_prompts(supervisor, client, node_id), name="prompt-cache-trim")
    assigned = asyncio.create_task(assignments.run(), name="assignments") if assignments is not None else None
    log.info(
        "node %s (incarnation %s) publishes %s on %s%s",
        node_id, publisher.incarnation,
        f"{len(supervisor.all_instances())} instances" if assignments is None
        else "the instances the scheduler assigns it (no [[models]] in its config)",
        settings.instances.host,
        f"; /health, /ready and /metrics on http://{settings.node.host}:{settings.node.port}"
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
        trimming.cancel()
        if assigned is not None:
            assigned.cancel()
        if http is not None and serving is not None:
            http.should_exit = True
            await serving
        await publisher.withdraw()
        await supervisor.stop()
        await client.aclose()
        log.info("node %s stopped", node_id)


def listener_url(settings: Settings, listening: socket.socket | None) -> str | None:
    """The node listener's address as gateways reach it: its bind address, or the address its instances are
    advertised at when it listens on every address; None when it has none they can reach (it listens on
    loopback while its instances are advertised elsewhere: gateways on other hosts could not reach it)."""
    if listening is None:
        return None
    port = listening.getsockname()[1]
    bound, advertised = settings.node.host, settings.instances.host
    if bound in ("", "0.0.0.0", "::"):
        host = advertised
    elif is_loopback(bound) and not is_loopback(advertised):
        return None
    else:
        host = bound
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


TRIM_EVERY = 10.0  # seconds between trims of the saved prompts the gateways write into this node's folders


async def _trim_saved_prompts(supervisor: Supervisor, client: redis.asyncio.Redis, node_id: str) -> None:
    """Keep the node's saved prompts within `prompt_cache.disk_mb`: gateways save conversations into its
    instances' folders (cluster/slots.py); the states their index no longer names go, then the least
    recently used."""
    saved = supervisor.saved_prompts
    if saved is None:
        return
    while True:
        await asyncio.sleep(TRIM_EVERY)
        try:
            await sweep_superseded(client, node_id, saved.root)
            await asyncio.to_thread(saved.trim)
        except Exception:
            log.exception("saved prompt caches not trimmed")
