"""Many tenants' conversations at once on one instance: how much of each later turn's prompt comes from the
cache, and how long its first token takes, under `prompt_cache.isolation = "key"` (with the per-key tier of
saved prompts under the slots, and without it) and `"shared"`.

    python -m bench.tenants [--keys 8] [--turns 4] [--slots 4] [--history 700] [--gateways 1 [--nodes 1]]
                            [--out FILE]

One gateway in front of one instance of the embedded model with `--slots` slots; with `--gateways 2`, two
gateways of role `gateway` (PostgreSQL + Redis, private servers started as the tests start them) in front
of an `llmserver node` that runs the instance, each conversation's turns going through them in turn; with
`--nodes 2` as well, two nodes whose instances have `--slots` between them (half each, and one thread each:
the two cores of the one-instance runs). Each
of `--keys` API keys holds one conversation and all of them talk at once: a first turn of about
`--history` prompt tokens of its own, then `--turns - 1` more, each a short question after the last
answer, with `--read` seconds of reading between an answer and the next question. Every turn is streamed
(`max_tokens` 16, greedy) and timed to its first token; its usage gives the prompt and cached tokens.
Four settings in one run, one after another on fresh servers: `key` (the default: the tier on), `key`
with `prompt_cache.disk_mb = 0` (the tier off: what `key` was before it), `shared`, and the reference:
plain `llama-server` with the instance's arguments and its own RAM prompt cache, no gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.targets import (
    Target,
    free_port,
    free_port_range,
    migrated_database,
    model_config,
    start_llama_server,
    wait_ready,
)
from llmserver.models.files import embedded_model_path
from tests.support.services import Postgres, Redis

ADMIN = "bench-admin-key-tenants-0123456789"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
WORDS = ["river", "stone", "light", "paper", "garden", "window", "music", "engine", "forest", "letter", "copper"]
SETTINGS = {  # name: (isolation, disk_mb)
    "key": ("key", 4096),
    "key, tier off": ("key", 0),
    "shared": ("shared", 4096),
    "llama-server": ("", 0),  # the reference: plain llama-server, its own RAM prompt cache, no gateway
}


@dataclass
class Turn:
    key: int
    number: int
    seconds_to_first_token: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Result:
    setting: str
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    saved: dict[str, int] = field(default_factory=dict)

    def later(self) -> list[Turn]:
        return [turn for turn in self.turns if turn.number > 1]

    def cached_fraction(self) -> float:
        later = self.later()
        return sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later))

    def ttft(self, quantile: float) -> float:
        values = sorted(t.seconds_to_first_token for t in self.later())
        return values[min(len(values) - 1, int(quantile * len(values)))]


def opening(seed: int, tokens: int) -> str:
    """About `tokens` tokens of text of conversation `seed`'s own (a word here is about 1.06 tokens)."""
    words = [WORDS[(seed * 7 + n * 3 + n // 11) % len(WORDS)] for n in range(int(tokens / 1.06))]
    return f"Notes of team {seed}: " + " ".join(words)


def config(slots: int, isolation: str, disk_mb: int, threads: int = 2) -> str:
    return f"""prompt_cache.isolation = "{isolation}"
prompt_cache.disk_mb = {disk_mb}

[[models]]
name = "chat"
path = "{embedded_model_path()}"
parallel = {slots}
ctx_size = {slots * 2048}
threads = {threads}
min_instances = 1
max_instances = 1
"""


class Gateway:
    def __init__(self, data_dir: Path, log: Path, cluster: dict[str, str] | None = None) -> None:
        """`cluster`: the environment of a gateway of role `gateway` (its database, Redis, instance key)."""
        port = free_port()
        env = {**os.environ, "LLMSERVER_ADMIN_KEY": ADMIN, **(cluster or {})}
        env["LLMSERVER_INSTANCES__BASE_PORT"] = str(free_port_range(4, avoid=port))
        with log.open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "llmserver", "serve", "--config", str(data_dir / "config.toml"),
                 "--data-dir", str(data_dir), "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.target = wait_ready(Target("llmserver", f"http://127.0.0.1:{port}", process, HEADERS), "/ready", 300)
        self.url = self.target.url

    def serving(self) -> int:
        """How many instances are ready behind it (nodes' once published)."""
        listed = httpx.get(self.url + "/api/instances", headers=HEADERS, timeout=30).json()["data"]
        return sum(instance["status"] in ("ready", "busy") for instance in listed)

    def key(self, name: str) -> str:
        created = httpx.post(self.url + "/api/keys", headers=HEADERS, json={"name": name}, timeout=30)
        created.raise_for_status()
        return str(created.json()["key"])


class Cluster:
    """Two gateways of role `gateway` on private PostgreSQL and Redis servers, and the nodes that run the
    instances they share (one each: `node_config`)."""

    INSTANCE_KEY = "bench-tenants-instance-key-0123456789"

    def __init__(self, data_dir: Path, logs: Path, nodes: int = 1, node_config: str | None = None) -> None:
        self.postgres, self.redis = Postgres().start(), Redis().start()
        self.gateways: list[Gateway] = []
        self.nodes: list[subprocess.Popen[bytes]] = []
        try:
            url = migrated_database(self.postgres)
            for n in range(nodes):
                node_dir = data_dir / f"node-{n}"
                node_dir.mkdir()
                (node_dir / "config.toml").write_text(node_config or (data_dir / "config.toml").read_text())
                env = {**os.environ, "LLMSERVER_NODE__ID": f"bench-node-{n}", "LLMSERVER_NODE__PORT": str(free_port()),
                       "LLMSERVER_INSTANCES__API_KEY": self.INSTANCE_KEY,
                       "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4))}  # fmt: skip
                with (logs / f"tenants-node-{n}.log").open("ab") as out:
                    self.nodes.append(subprocess.Popen(
                        [sys.executable, "-m", "llmserver", "node", "--config", str(node_dir / "config.toml"),
                         "--data-dir", str(node_dir), "--redis-url", self.redis.url],
                        stdout=out, stderr=subprocess.STDOUT, env=env,
                    ))  # fmt: skip
            for name in ("gw-a", "gw-b"):
                gateway_dir = data_dir / name
                gateway_dir.mkdir()
                (gateway_dir / "config.toml").write_text((data_dir / "config.toml").read_text())
                cluster = {"LLMSERVER_ROLE": "gateway", "LLMSERVER_STATE__DATABASE_URL": url,
                           "LLMSERVER_STATE__REDIS_URL": self.redis.url, "LLMSERVER_STATE__GATEWAY_ID": name,
                           "LLMSERVER_INSTANCES__API_KEY": self.INSTANCE_KEY}  # fmt: skip
                self.gateways.append(Gateway(gateway_dir, logs / f"tenants-{name}.log", cluster))
            deadline = time.monotonic() + 300
            while not all(gateway.serving() >= nodes for gateway in self.gateways):
                if time.monotonic() > deadline:
                    raise RuntimeError("the nodes' instances did not reach the gateways within 300 s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.target.stop()
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.wait(60)
        self.redis.stop()
        self.postgres.stop()


async def conversation(
    clients: list[httpx.AsyncClient], key: str, seed: int, turns: int, history: int, read: float, result: Result
) -> None:
    """One key's conversation; its turns go through `clients` (gateways) in turn."""
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": opening(seed, history) + "\nWhich word comes first?"},
    ]
    for number in range(1, turns + 1):
        client = clients[(seed + number) % len(clients)]
        started = time.perf_counter()
        first: float | None = None
        text, usage, timings = [], {}, {}
        body = {"model": "chat", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as answer:
            if answer.status_code != 200:
                raise RuntimeError(f"{answer.status_code}: {(await answer.aread())[:300]!r}")
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    if piece := (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(piece)
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings  # plain llama-server's: its cache_n
        details = usage.get("prompt_tokens_details") or {"cached_tokens": timings.get("cache_n")}
        result.turns.append(
            Turn(seed, number, (first or time.perf_counter()) - started, int(usage.get("prompt_tokens", 0)),
                 int(details.get("cached_tokens") or 0))
        )  # fmt: skip
        messages += [{"role": "assistant", "content": "".join(text) or "River."},
                     {"role": "user", "content": f"Question {number}: and which word comes next?"}]  # fmt: skip
        await asyncio.sleep(read)


def measure(
    setting: str,
    keys: int,
    turns: int,
    slots: int,
    history: int,
    read: float,
    logs: Path,
    gateways: int = 1,
    nodes: int = 1,
) -> Result:
    """`nodes` (with two gateways): the `slots` shared out between that many nodes' instances."""
    isolation, disk_mb = SETTINGS[setting]
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-tenants-"))
    (data_dir / "config.toml").write_text(config(slots, isolation, disk_mb))
    if setting == "llama-server":
        return _measure_direct(keys, turns, slots, history, read, logs)
    # Two nodes share this machine's two cores as one instance does: one thread each.
    each = config(max(1, slots // nodes), isolation, disk_mb, threads=max(1, 2 // nodes))
    cluster = Cluster(data_dir, logs, nodes, each) if gateways > 1 else None
    front = cluster.gateways if cluster is not None else [Gateway(data_dir, logs / "tenants.log")]
    where = "a node" if nodes == 1 else f"{nodes} nodes"
    result = Result(setting if cluster is None else f"{setting}, 2 gateways + {where}")
    try:
        secrets = [front[0].key(f"tenant-{n}") for n in range(keys)]
        _talk([gateway.url for gateway in front], secrets, turns, history, read, result)
        files = list(data_dir.glob("**/prompt-cache/*/*/*.slot"))  # the gateway's, or the node's
        result.saved = {"files": len(files), "bytes": sum(path.stat().st_size for path in files)}
    finally:
        if cluster is not None:
            cluster.stop()
        else:
            front[0].target.stop()
    return result


def _measure_direct(keys: int, turns: int, slots: int, history: int, read: float, logs: Path) -> Result:
    """The same conversations straight to a plain llama-server of the instance's arguments, its RAM prompt
    cache on (what a single-tenant deployment without a gateway gets)."""
    target = start_llama_server(model_config(parallel=slots, ctx_size=slots * 2048, threads=2), logs)
    result = Result("llama-server")
    try:
        _talk([target.url], ["none"] * keys, turns, history, read, result)
    finally:
        target.stop()
    return result


def _talk(urls: list[str], secrets: list[str], turns: int, history: int, read: float, result: Result) -> None:
    """Every key's conversation at once, each through `urls` in turn; the run's time into `result`."""

    async def everyone() -> None:
        clients = [httpx.AsyncClient(base_url=url, timeout=600) for url in urls]
        try:
            await asyncio.gather(
                *(conversation(clients, key, n, turns, history, read, result) for n, key in enumerate(secrets))
            )
        finally:
            for client in clients:
                await client.aclose()

    started = time.perf_counter()
    asyncio.run(everyone())
    result.seconds = time.perf_counter() - started


def report(
    results: list[Result],
    keys: int,
    turns: int,
    slots: int,
    read: float,
    level: str = "#",
    gateways: int = 1,
    nodes: int = 1,
) -> str:
    prompt = statistics.median(t.prompt_tokens for r in results for t in r.turns if t.number == 1)
    runs = "one instance an `llmserver node` runs" if nodes == 1 else f"the instances of {nodes} `llmserver node`s"
    where = (
        f"through two gateways of role `gateway` (PostgreSQL + Redis) to {runs}, "
        "each conversation's turns through the two in turn, "
        if gateways > 1
        else ""
    )
    instances = (
        f"one instance of the embedded model with {slots} slots"
        if nodes == 1 or gateways == 1
        else f"{nodes} instances of the embedded model with {max(1, slots // nodes)} slots and one thread each"
    )
    command = (" --gateways 2" if gateways > 1 else "") + (f" --nodes {nodes}" if gateways > 1 and nodes > 1 else "")
    lines = [
        f"{level} Many tenants at once: the per-key tier against recomputing and against a shared cache",
        "",
        f"`python -m bench.tenants{command}`: {keys} keys, one conversation each, "
        f"all at once, {turns} turns of which the first reads about {prompt:,.0f} prompt tokens, {read:g} s of "
        f"reading between turns, {where}on {instances}{' (2 threads)' if nodes == 1 or gateways == 1 else ''}. "
        f"Later turns: turns 2 to {turns}.",
        "",
        "| setting | later turns' prompt from the cache | later turns' first token p50 / p95 | first turns' "
        "first token p50 | the whole run | saved conversations |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        first = statistics.median(t.seconds_to_first_token for t in r.turns if t.number == 1)
        saved = f"{r.saved['files']} ({r.saved['bytes'] / 2**20:,.0f} MiB)" if r.saved.get("files") else "none"
        lines.append(
            f"| {r.setting} | {r.cached_fraction():.2f} | {r.ttft(0.5):.2f} s / {r.ttft(0.95):.2f} s | "
            f"{first:.2f} s | {r.seconds:.1f} s | {saved} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--history", type=int, default=700, help="prompt tokens of a conversation's first turn")
    parser.add_argument("--read", type=float, default=0.5, help="seconds between an answer and the next question")
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS))
    two = "2: two gateways and a node on PostgreSQL + Redis, each conversation's turns through each in turn"
    parser.add_argument("--gateways", type=int, choices=(1, 2), default=1, help=two)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="with --gateways 2: nodes sharing --slots")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    results = [
        measure(setting, args.keys, args.turns, args.slots, args.history, args.read, logs, args.gateways, args.nodes)
        for setting in args.settings
    ]
    text = report(results, args.keys, args.turns, args.slots, args.read, gateways=args.gateways, nodes=args.nodes)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
