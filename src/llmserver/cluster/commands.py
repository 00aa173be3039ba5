"""The admin API reaches nodes through a command channel: a gateway pushes `start` or `drain` onto
the node's list (`llmserver:node:ID:commands`), the node runs it and pushes the outcome onto a reply
list the gateway waits on. Each node also publishes its own record (`llmserver:node:ID`: models,
instances), so that a gateway can pick the node with the fewest instances of the model.

This is the gateway's end; the node's is cluster/publisher.py (`serve_commands`).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from llmserver.cluster.records import NODE_KEY, scan_json
from llmserver.errors import APIError, GatewayTimeout

if TYPE_CHECKING:
    import redis.asyncio

POP_SECONDS = 1  # one blocking wait for a node's reply (under the Redis connections' 2-s socket timeout)


class NodeCommands:
    """Commands to the nodes, and their records."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._redis = client

    async def command(self, node: str, op: str, timeout: float, **args: str) -> dict[str, Any]:
        """Send a node a command and wait for its outcome (504 when it does not answer in time)."""
        command_id = secrets.token_hex(8)
        await self._redis.rpush(NODE_KEY + node + ":commands", json.dumps({"id": command_id, "op": op, **args}))
        deadline = time.monotonic() + max(1.0, timeout)
        popped = None
        # A second at a time: the connection's socket timeout (2 s) would cut one long blocking pop, and a start
        # or a drain (its replacement started first) can take longer.
        while popped is None and time.monotonic() < deadline:
            popped = await self._redis.blpop([f"llmserver:reply:{command_id}"], timeout=POP_SECONDS)
        if popped is None:
            raise GatewayTimeout(f"Node {node!r} did not answer the {op} command within {timeout:.0f} s.")
        reply: dict[str, Any] = json.loads(popped[1])
        if not reply["ok"]:
            error = type("NodeError", (APIError,), {"status": reply["status"], "type": reply["type"]})
            raise error(f"Node {node!r}: {reply['message']}")
        return reply

    async def nodes(self) -> list[dict[str, Any]]:
        return await scan_json(self._redis, NODE_KEY)
