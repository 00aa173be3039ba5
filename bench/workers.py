"""Tiny-request capacity through `serve --workers 1` and `--workers 2`, against the instance itself.

    python -m bench.workers [--seconds S] [--out FILE]

A node (`llmserver node`) runs one instance of the embedded model (4 slots, 2 threads); two gateways
of role `gateway` on PostgreSQL + Redis route to it, one with one worker, one with two. Private
PostgreSQL and Redis servers are started as the tests start them (tests/support/services.py). For 1, 4 and
16 clients, each target in turn takes tiny requests (`max_tokens: 1`, non-streamed) for S seconds:
requests/s, median latency and the gateway's CPU per request (its processes together: the
supervisor and its workers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import load
from bench.targets import Target, free_port, migrated_database, model_config, model_toml, start_llmserver, wait_ready
from tests.support.services import Postgres, Redis

LEVELS = (1, 4, 16)
INSTANCE_KEY = secrets.token_urlsafe(16)  # the node's instances demand it, from the gateways and this benchmark


def tree_cpu_seconds(target: Target) -> float:
    """CPU time of the target's process and its children (a supervisor and its workers)."""
    root = psutil.Process(target.pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def start_node(config: str, redis_url: str, logs: Path) -> tuple[subprocess.Popen[bytes], Target]:
    """`llmserver node` and its instance, as a target of its own (the engine, reached with the instance key)."""
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-node-"))
    (data_dir / "config.toml").write_text(config)
    port = free_port()
    env = {**os.environ, "LLMSERVER_INSTANCES__BASE_PORT": str(port), "LLMSERVER_NODE__ID": "bench-node",
           "LLMSERVER_NODE__PORT": str(free_port()),
           "LLMSERVER_INSTANCES__API_KEY": INSTANCE_KEY}  # fmt: skip
    with (logs / "node.log").open("ab") as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "llmserver", "node", "--config", str(data_dir / "config.toml"),
             "--data-dir", str(data_dir), "--redis-url", redis_url],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    instance = Target("llama-server", f"http://127.0.0.1:{port}", node, {"Authorization": f"Bearer {INSTANCE_KEY}"})
    return node, wait_ready(instance, "/health")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per target and level (default 10)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/workers.md"))
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    model = model_config(parallel=4, ctx_size=2048, threads=2)
    config = model_toml(model)
    postgres, redis = Postgres().start(), Redis().start()
    node: subprocess.Popen[bytes] | None = None
    gateways: list[Target] = []
    results: Results = {}
    try:
        url = migrated_database(postgres)
        node, instance = start_node(config, redis.url, logs)
        for workers in (1, 2):
            env = {
                "LLMSERVER_STATE__DATABASE_URL": url, "LLMSERVER_STATE__REDIS_URL": redis.url,
                "LLMSERVER_ROLE": "gateway",
                "LLMSERVER_SERVER__WORKERS": str(workers), "LLMSERVER_STATE__GATEWAY_ID": f"bench-{workers}w",
                "LLMSERVER_INSTANCES__API_KEY": INSTANCE_KEY,
            }  # fmt: skip
            gateways.append(start_llmserver(model, logs, name=f"{workers} worker{'s' * (workers > 1)}", env=env))
        targets = [instance, *gateways]
        for target in targets:  # warm: connections, prompt cache, every worker
            asyncio.run(load.capacity(target, 4, 1.0))
        for number, clients in enumerate(LEVELS):
            for target in targets if number % 2 == 0 else list(reversed(targets)):
                before = tree_cpu_seconds(target) if target.gateway else 0.0
                rate, median, _ = asyncio.run(load.capacity(target, clients, args.seconds))
                cpu = (tree_cpu_seconds(target) - before) / (rate * args.seconds) if target.gateway else float("nan")
                results[(target.name, clients)] = (rate, median, cpu)
                print(f"[{time.strftime('%H:%M:%S')}] {target.name}, {clients} clients: {rate:.1f} req/s", flush=True)
    finally:
        for target in gateways:
            target.stop()
        if node is not None:
            node.terminate()
            node.wait(60)
        redis.stop()
        postgres.stop()
    write(args.out, args.seconds, [t.name for t in targets], results)
    print(args.out.read_text())


Results = dict[tuple[str, int], tuple[float, float, float]]  # (target, clients) → req/s, p50 s, CPU s per request


def write(out: Path, seconds: float, names: list[str], results: Results) -> None:
    lines = [
        "# Tiny-request capacity: one gateway worker against two",
        "",
        f"`python -m bench.workers --seconds {seconds:g}`: `llmserver node` with one instance of the embedded model",
        "(4 slots, 2 threads); gateways of role `gateway` on PostgreSQL + Redis (this machine, loopback) with",
        f"`--workers 1` and `--workers 2`; tiny requests (`max_tokens: 1`) from 1, 4 and 16 clients for {seconds:g} s",
        "per target and level, the targets' order alternating by level. CPU per request: the gateway's",
        "processes together (with two workers: the supervisor and both workers).",
        "",
        "| clients | target | req/s | ratio to llama-server | p50 ms | gateway CPU per request, ms |",
        "|---|---|---|---|---|---|",
    ]
    for clients in LEVELS:
        direct = results[("llama-server", clients)][0]
        for name in names:
            rate, median, cpu = results[(name, clients)]
            cpu_ms = "-" if cpu != cpu else f"{cpu * 1000:.2f}"  # NaN: not a gateway
            lines.append(f"| {clients} | {name} | {rate:.1f} | {rate / direct:.3f} | {median * 1000:.1f} | {cpu_ms} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
