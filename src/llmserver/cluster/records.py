"""The keys, leases and record of the instance registry in Redis, which every part of the cluster shares
(how nodes publish and gateways read: cluster/registry.py).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from llmserver.pool.instance import Instance, Status

if TYPE_CHECKING:
    import redis.asyncio


KEY = "llmserver:instance:"
NODE_KEY = "llmserver:node:"
LOAD_KEY = "llmserver:load:"
LOAD_CHANNEL = "llmserver:load"
ASSIGN_KEY = "llmserver:assign:"  # + node id: what the scheduler (cluster/scheduler.py) has it run
# + instance id: the process of a node's instance that its watchdog restarted, and why (cluster/publisher.py
# `stalled`): a gateway whose request that process drops fails it with the reason rather than sending it again.
STALL_KEY = "llmserver:stalled:"
STALL_NOTE_SECONDS = 300
STATUS_KEY = "llmserver:schedule"  # the scheduler's last round: the catalog, and what it could not place
LEASE_MS = 3000
STOPPED_MS = 5000  # how long a cleanly stopped node's instances stay in the registry, marked stopped
ACTIVE_WINDOW = 10.0  # seconds: a gateway's load names the instances it used this recently
PUBLISH_EVERY = 1.0
READ_EVERY = 0.5
PUBLISHED = (Status.READY, Status.BUSY, Status.DRAINING)


async def scan_json(client: redis.asyncio.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every JSON value stored under keys starting with `prefix` (keys of other types, such as a
    node's command list, read as nothing)."""
    keys = [key async for key in client.scan_iter(match=prefix + "*", count=500)]
    return [json.loads(value) for value in await client.mget(keys) if value] if keys else []


def record(instance: Instance, node_id: str, incarnation: str, in_flight: int = 0) -> dict[str, Any]:
    return {
        **instance.describe(),
        "slots": instance.model.parallel,
        "in_flight": in_flight,  # through every gateway, from their loads
        "node": node_id,
        "incarnation": incarnation,
        "scheme": "http" if instance.tls is None else "https",
        # Its slots' prompt caches are saved into a folder of this identity (gateways index them: cluster/slots.py).
        "prompts": instance.prompt_folder.name if instance.prompt_folder is not None else None,
        # Kept by a request's keep_alive: not idle for the scheduler until then.
        "idle_seconds": 0.0
        if in_flight or instance.keep_until > time.time()
        else round(max(0.0, time.time() - instance.last_activity), 1),
    }
