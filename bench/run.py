"""`python -m bench`: llmserver against direct llama-server (and llama-cpp-python when installed),
in one run on this machine, with a Markdown report and charts.

    .venv/bin/python -m bench            # full: the report committed in bench/results/
    .venv/bin/python -m bench --quick    # under a minute here: a smoke test of the harness

Each concurrency level is run on every target in turn, in blocks of a few requests per client, the
targets taking turns in mirrored pairs of orders (`load.turn`), so that drift in the machine's speed
hits all of them alike; before a level's blocks, every target serves one uncounted request per
client at that level (`_warm`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import affinity as affinity_workload
from bench import load, report, saved_prompts
from bench import peers as peers_module
from bench.peers import PEERS
from bench.plan import FULL, QUICK, Plan, Results
from bench.targets import (
    Target,
    model_config,
    start_llama_server,
    start_llmserver,
    start_passthrough,
)
from llmserver.settings import ModelConfig

ADMIN_KEY = "bench-admin-key-0123456789"


def blocks(plan: Plan, concurrency: int) -> int:
    """Blocks of `plan.per_client` requests per client that each target runs at a level: at least
    `plan.repeats`, and enough for `plan.min_requests` in all. A block at 1 client lasts seconds, so
    a slow drift in the machine's speed falls alike on the targets taking turns: a run with two
    blocks of 12 requests (13 s each) per target read 0.960 and 1.017 x direct for the same gateway,
    where runs taking turns request by request read 0.988 to 0.997 (and the pass-through the same)."""
    return max(plan.repeats, -(-plan.min_requests // (concurrency * plan.per_client)))


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


PEER_STARTERS = {
    "litellm": lambda upstream, model, logs: peers_module.start_litellm(upstream, model, logs),
    "llama-cpp-python": lambda upstream, model, logs: peers_module.start_llama_cpp_python(model, logs),
}


def run(plan: Plan, out: Path, peers: list[str]) -> Results:
    started = time.perf_counter()
    model = model_config(plan.parallel, plan.ctx_size, plan.threads)
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    progress(f"{plan.mode} run; server logs in {logs}")
    targets: list[Target] = []
    notes: list[str] = []
    try:
        progress("starting llmserver and a plain llama-server with the same model, slots and threads")
        targets.append(start_llmserver(model, logs))
        targets.append(start_llama_server(model, logs))
        progress("starting the bare pass-through proxy in front of that llama-server (the floor)")
        targets.append(start_passthrough(targets[1], logs))
        for peer in peers:
            progress(f"starting {peer} (its own virtual environment under {PEERS})")
            try:
                target, version = PEER_STARTERS[peer](targets[1], model, logs)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                notes.append(f"{peer} could not be started, so it was not measured: {exc}")
                progress(f"  {peer} failed to start: {exc}")
                continue
            targets.append(target)
            notes.append(f"{peer} {version}, from PyPI in its own virtual environment.")
        if not peers:
            notes.append("No other servers in this run (`--peers litellm,llama-cpp-python` adds them).")
        results = Results(plan, [t.name for t in targets], notes=notes)
        gateway = targets[0]
        sampler = load.RSSSampler(gateway.pid)
        time.sleep(1.0)
        results.rss_idle = sampler.rss()
        with sampler:
            _throughput(plan, targets, results)
            progress(f"gateway overhead: {plan.overhead_requests} max_tokens=1 requests a target, {load.BLOCK} in turn")
            proxied = [t for t in targets if t.name != "llama-cpp-python"]  # llmserver, direct, the floor, LiteLLM
            results.overhead, results.overhead_cpu = asyncio.run(load.overhead(proxied, plan.overhead_requests))
            for concurrency in plan.capacity_levels:
                runs: dict[str, list[tuple[float, float, float]]] = {}
                for i in range(plan.repeats):  # each target in each place in turn, as for the streams
                    for target in load.turn(proxied, i):
                        progress(f"capacity: {target.name}, {concurrency} clients, {plan.capacity_seconds:g} s")
                        measured = asyncio.run(load.capacity(target, concurrency, plan.capacity_seconds))
                        runs.setdefault(target.name, []).append(measured)
                for name, measures in runs.items():
                    rate, p50, cpu = (statistics.median(values) for values in zip(*measures, strict=True))
                    results.capacity.setdefault(name, []).append((concurrency, rate, p50, cpu))
        results.rss_peak = sampler.peak
    finally:
        for target in targets:
            target.stop()
    _affinity(plan, model, logs, results)
    progress(f"saved prompt caches: {plan.saved_conversations} conversations of {plan.saved_history} tokens, 3 events")
    restored, recomputed = saved_prompts.compare(plan.saved_conversations, plan.saved_history, logs)
    results.saved_prompts = saved_prompts.report(restored, recomputed, plan.saved_conversations, level="##")
    results.seconds = time.perf_counter() - started
    report.write(results, out)
    progress(f"done in {results.seconds:.0f} s: {out / 'report.md'}")
    return results


def _throughput(plan: Plan, targets: list[Target], results: Results) -> None:
    for target in targets:  # warm up: first-request costs are not what we measure
        asyncio.run(load.run_level(target, 1, 1, 8))
    # Peers just started may still be busy (imports, model loading): a run measured its first target
    # at 0.85 x direct while they were, and 1.12 x in the next repeat.
    busy = load.settle()
    progress(f"machine quiet ({busy:.0f}% CPU) before measuring")
    for concurrency in plan.levels:
        _warm(plan, targets, concurrency)
        count = blocks(plan, concurrency)
        for block in range(count):
            order = load.turn(targets, block)  # each target in each place in turn
            for target in order:
                requests = concurrency * plan.per_client
                progress(
                    f"concurrency {concurrency}, block {block + 1}/{count}: {target.name}, "
                    f"{requests} streamed requests of {plan.max_tokens} tokens"
                )
                cpu_before = load.cpu_seconds(target) if target.gateway else 0.0
                samples, seconds = asyncio.run(load.run_level(target, concurrency, plan.per_client, plan.max_tokens))
                cpu = load.cpu_seconds(target) - cpu_before if target.gateway else 0.0
                level = results.levels.setdefault(target.name, {}).setdefault(
                    concurrency, load.LevelResult(target.name, concurrency)
                )
                level.samples += samples
                level.seconds += seconds
                level.cpu_seconds += cpu
                tokens = sum(s.tokens for s in samples)
                level.blocks.append(tokens / seconds)
                ttft = statistics.median(s.ttft for s in samples) * 1000
                per_token = f", gateway CPU {cpu * 1000 / tokens:.3f} ms/token" if target.gateway else ""
                progress(f"  {level.blocks[-1]:.1f} tok/s, median TTFT {ttft:.0f} ms{per_token}")


def _warm(plan: Plan, targets: list[Target], concurrency: int) -> None:
    """One uncounted request per client on every target at a new level, before its blocks. The first
    target to reach a level met slots and connections not used at the level before: at 4 clients,
    llmserver (always first in the level's first block) read 139.9-147.8 tokens/s in its first block
    in five runs and 150.6-154.9 in its second, the pass-through (third) 150-152 in both."""
    for target in targets:
        progress(f"concurrency {concurrency}: warming {target.name} up, {concurrency} requests, uncounted")
        asyncio.run(load.run_level(target, concurrency, 1, plan.warm_tokens))


def _affinity(plan: Plan, model: ModelConfig, logs: Path, results: Results) -> None:
    """Prompt-cache affinity against least-loaded routing: llmserver with two instances of one thread
    each (the machine's two CPUs), the conversation workload of bench/affinity.py on each routing."""
    two = model.model_copy(update={"min_instances": 2, "max_instances": 2, "parallel": 2, "threads": 1})
    for routing in ("affinity", "least_loaded"):
        progress(f"prompt-cache affinity: routing {routing}, {plan.conversations} conversations x {plan.turns} turns")
        target = start_llmserver(
            two,
            logs,
            name=f"llmserver-{routing}",
            settings=f'router.policy = "{routing}"\n',
            env={"LLMSERVER_ADMIN_KEY": ADMIN_KEY},
        )
        try:
            addresses = affinity_workload.instance_addresses(target.url, ADMIN_KEY)
            systems = affinity_workload.balanced_systems(model.name, addresses, plan.conversations)
            later = asyncio.run(affinity_workload.converse(target.url, target.headers, systems, plan.turns))
        finally:
            target.stop()
        results.affinity[routing] = later
        progress(f"  turns 2+: median {later.median_ms:.0f} ms, {later.cached_share:.1%} of prompt tokens cached")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute here) to check the harness")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default: bench/results[/quick])")
    parser.add_argument("--threads", type=int, default=None, help="llama-server threads (default: 2)")
    parser.add_argument("--parallel", type=int, default=None, help="slots per instance (default: 4)")
    parser.add_argument(
        "--peers",
        default=None,
        help="other servers to measure, comma-separated: litellm, llama-cpp-python (default: both in a full run, "
        "none with --quick; 'none' for none)",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.threads is not None:
        plan = dataclasses.replace(plan, threads=args.threads)
    if args.parallel is not None:
        plan = dataclasses.replace(plan, parallel=args.parallel)
    default = Path(__file__).resolve().parent / "results"
    out = args.out or (default / "quick" if args.quick else default)
    chosen = args.peers if args.peers is not None else ("none" if args.quick else ",".join(PEER_STARTERS))
    peers = [] if chosen == "none" else [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = set(peers) - set(PEER_STARTERS)
    if unknown:
        parser.error(f"unknown peers: {', '.join(sorted(unknown))}")
    run(plan, out, peers)
