"""What the shared state costs a tiny request: llmserver on SQLite (the default) against llmserver on
PostgreSQL + Redis, with a plain llama-server as the baseline, measured in one run.

    python -m bench.shared_state [--requests N] [--out FILE]

Private PostgreSQL and Redis servers are started as the tests start them (tests/support/services.py: Debian's
packages, temp folders, free ports). Each gateway serves one instance of the embedded model; the key
on each has a token quota (a reservation and a settlement per request), and on PostgreSQL + Redis
also rpm and max_concurrency (two Redis scripts per request), so every shared path is taken. Tiny
requests (max_tokens = 1) one at a time, alternating targets request by request; the report gives
each one's p50 and p90 and the gateway's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench import load
from bench.targets import Target, migrated_database, model_config, start_llama_server, start_llmserver
from llmserver.store import KeyLimits
from tests.support.services import Postgres, Redis

LIMITS = KeyLimits(quota_tokens=10**12, quota_period="month", rpm=10**6, max_concurrency=64)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_state", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="tiny requests per target (default 400)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/shared_state.md"))
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    model = model_config(parallel=4, ctx_size=2048, threads=2)
    postgres, redis = Postgres().start(), Redis().start()
    targets: list[Target] = []
    try:
        url = migrated_database(postgres)
        targets.append(start_llama_server(model, logs))
        targets.append(start_llmserver(model, logs, name="llmserver-sqlite", limits=LIMITS))
        shared = {"LLMSERVER_STATE__DATABASE_URL": url, "LLMSERVER_STATE__REDIS_URL": redis.url}
        targets.append(start_llmserver(model, logs, name="llmserver-postgres-redis", env=shared, limits=LIMITS))
        started = time.perf_counter()
        latencies, cpu = asyncio.run(load.overhead(targets, args.requests))
        seconds = time.perf_counter() - started
    finally:
        for target in targets:
            target.stop()
        redis.stop()
        postgres.stop()
    write(args.out, args.requests, seconds, latencies, cpu)
    print(args.out.read_text())


def write(out: Path, requests: int, seconds: float, latencies: dict[str, list[float]], cpu: dict[str, float]) -> None:
    def p(name: str, q: int) -> float:
        return statistics.quantiles(latencies[name], n=100)[q - 1] * 1000

    direct = p("llama-server", 50)
    lines = [
        "# Shared state: a tiny request on SQLite against PostgreSQL + Redis",
        "",
        f"`python -m bench.shared_state --requests {requests}`: {requests} tiny requests (max_tokens = 1) per target,",
        f"one at a time, alternating; {seconds:.0f} s in all. PostgreSQL 15 and Redis 7 on this machine (loopback).",
        "The keys have a token quota; on PostgreSQL + Redis also rpm and max_concurrency.",
        "",
        "| target | p50 ms | p90 ms | p50 added to llama-server, ms | gateway CPU per request, ms |",
        "|---|---|---|---|---|",
    ]
    for name in latencies:
        cpu_ms = f"{cpu[name] * 1000:.2f}" if name in cpu else "-"
        added = f"{p(name, 50) - direct:+.2f}" if name != "llama-server" else "-"
        lines.append(f"| {name} | {p(name, 50):.2f} | {p(name, 90):.2f} | {added} | {cpu_ms} |")
    extra = p("llmserver-postgres-redis", 50) - p("llmserver-sqlite", 50)
    lines += ["", f"PostgreSQL + Redis add **{extra:+.2f} ms** to the p50 of SQLite.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
