"""Toward many hosts, simulated: 100 nodes and 1,000 instances published in a private Redis by a
stand-in publisher (no llama-server), and what one gateway pays for them.

    python -m bench.cluster_scale [--nodes 100] [--per-node 10] [--rounds 20] [--out FILE]

Measured, medians of `--rounds`:
- a gateway's registry read (`Registry.read`: its load written, every instance record and every
  gateway's load scanned and fetched, the scheduler's status fetched): wall time and the process's
  CPU time per read; a gateway reads twice a second;
- the scheduler's `plan` placing 100 new instances (ten new models with `min_instances = 10`) beside
  the 1,000 running ones, and a whole scheduling round (`Scheduler.schedule`: reads, plan, writes);
- the Redis traffic of one gateway's registry reads for 10 s (commands and bytes per second, from
  Redis's own counters, with nothing else talking to it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis.asyncio

from llmserver.cluster.records import KEY, NODE_KEY, READ_EVERY
from llmserver.cluster.registry import Registry
from llmserver.cluster.scheduler import InstanceView, Model, NodeView, Scheduler, plan
from llmserver.store import CatalogEntry
from tests.support.services import Redis

MODELS = 100  # the catalog's models; each node runs per_node instances of them


def stand_in(nodes: int, per_node: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Node and instance records as `llmserver node` publishes them."""
    node_records, instances = [], []
    for n in range(nodes):
        name = f"node-{n:03d}"
        checks = {f"model-{m:03d}": {"revision": 1, "estimate_mb": 300} for m in range(MODELS + 10)}
        node_records.append({"node": name, "incarnation": "x", "models": [], "instances": per_node,
                             "memory_used_mb": per_node * 300, "memory_budget_mb": 64_000, "scheduled": True,
                             "labels": {}, "checks": checks})  # fmt: skip
        for i in range(per_node):
            model = f"model-{(n * per_node + i) % MODELS:03d}"
            instances.append({
                "instance_id": f"{name}-{i}", "model": model, "status": "ready", "host": f"10.1.{n // 250}.{n % 250}",
                "port": 8001 + i, "pid": 1000 + i, "active_users": 0, "ram_used_mb": 300, "cpu_percent": 0.0,
                "uptime_seconds": 100, "last_activity": "2026-12-02T00:00:00+00:00", "slots": 4, "in_flight": 0,
                "node": name, "incarnation": "x", "scheme": "http", "idle_seconds": 1.0,
            })  # fmt: skip
    return node_records, instances


async def publish(client: redis.asyncio.Redis, nodes: list[dict[str, Any]], instances: list[dict[str, Any]]) -> None:
    pipe = client.pipeline(transaction=False)
    for record in nodes:
        pipe.set(NODE_KEY + record["node"], json.dumps(record))
    for record in instances:
        pipe.set(KEY + record["instance_id"], json.dumps(record))
    await pipe.execute()


def catalog_entries(models: int) -> list[CatalogEntry]:
    return [
        CatalogEntry(f"model-{m:03d}", json.dumps({"name": f"model-{m:03d}", "max_instances": 64,
                                                    "min_instances": 10 if m >= MODELS else 1}), "api", 1, 0.0)
        for m in range(models)
    ]  # fmt: skip


class _Catalog:
    def __init__(self, entries: list[CatalogEntry]) -> None:
        self.entries = entries


class _Store:
    """What the scheduler asks of the database here: its lease (always held) and node marks (none)."""

    async def lease_take(self, name: str, holder: str, seconds: float) -> bool:
        return True

    async def lease_release(self, name: str, holder: str) -> None:
        return None

    async def node_marks(self) -> list[object]:
        return []  # no node cordoned or draining


def median_of(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def measure(nodes: int, per_node: int, rounds: int, window: float = 10.0) -> dict[str, Any]:
    server = Redis().start()
    try:
        client = redis.asyncio.Redis.from_url(server.url)
        node_records, instances = stand_in(nodes, per_node)
        await publish(client, node_records, instances)
        registry = Registry(client, {}, None, "bench-gateway")
        reads, read_cpu = [], []
        for _ in range(rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            read = await registry.read()
            reads.append(time.perf_counter() - wall)
            read_cpu.append(time.process_time() - cpu)
            assert read is not None and len(read[0]) == len(instances)

        # The scheduler: 10 new models of min_instances 10 beside the running 1,000 instances.
        entries = catalog_entries(MODELS + 10)
        models = [Model.of(entry) for entry in entries]
        views = [NodeView(r["node"], r["memory_budget_mb"], checks=r["checks"]) for r in node_records]
        running = [InstanceView(r["instance_id"], r["node"], r["model"], ram_mb=300) for r in instances]
        current: dict[str, dict[str, int]] = {}
        for record in instances:
            counts = current.setdefault(record["node"], {})
            counts[record["model"]] = counts.get(record["model"], 0) + 1
        plans = []
        for _ in range(rounds):
            started = time.perf_counter()
            decided = plan(models, views, running, {}, current)
            plans.append(time.perf_counter() - started)
        placed = sum(counts.get(m.name, 0) for counts in decided.assignments.values() for m in models[MODELS:])
        assert placed == 10 * (MODELS + 10 - MODELS), placed  # ten new models, ten instances each
        scheduler = Scheduler(_Store(), client, "bench-gateway", _Catalog(entries), 5.0)  # type: ignore[arg-type]
        rounds_full = []
        for _ in range(max(3, rounds // 4)):
            started = time.perf_counter()
            await scheduler.schedule()
            rounds_full.append(time.perf_counter() - started)

        # One gateway's registry reads for `window` s, as it reads them (every READ_EVERY s), Redis's counters
        # around.
        before = await client.info("stats")
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            await registry.read()
            await asyncio.sleep(READ_EVERY)
        after = await client.info("stats")
        seconds = window
        await client.aclose()
        return {
            "nodes": nodes,
            "instances": len(instances),
            "registry_read_ms": median_of(reads),
            "registry_read_cpu_ms": median_of(read_cpu),
            "plan_100_new_ms": median_of(plans),
            "schedule_round_ms": median_of(rounds_full),
            "redis_commands_per_s": (after["total_commands_processed"] - before["total_commands_processed"]) / seconds,
            "redis_kib_out_per_s": (after["total_net_output_bytes"] - before["total_net_output_bytes"])
            / seconds
            / 1024,
            "redis_kib_in_per_s": (after["total_net_input_bytes"] - before["total_net_input_bytes"]) / seconds / 1024,
        }
    finally:
        server.stop()


def report(figures: dict[str, Any]) -> str:
    return "\n".join([
        f"# Many hosts, simulated: {figures['nodes']} nodes, {figures['instances']} instances",
        "",
        "| measure | median |",
        "|---|---|",
        f"| a gateway's registry read (wall) | {figures['registry_read_ms']:.1f} ms |",
        f"| a gateway's registry read (its CPU) | {figures['registry_read_cpu_ms']:.1f} ms |",
        f"| the scheduler's plan placing 100 new instances beside {figures['instances']} | "
        f"{figures['plan_100_new_ms']:.1f} ms |",
        f"| a whole scheduling round (reads, plan, writes) | {figures['schedule_round_ms']:.1f} ms |",
        f"| Redis traffic of one gateway's reads | {figures['redis_commands_per_s']:.0f} commands/s, "
        f"{figures['redis_kib_out_per_s']:.0f} KiB/s out, {figures['redis_kib_in_per_s']:.1f} KiB/s in |",
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--per-node", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = report(asyncio.run(measure(args.nodes, args.per_node, args.rounds)))
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
