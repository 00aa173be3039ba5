"""The gateway's own cost, without the model's: llmserver and the bare pass-throughs in front of an
upstream that answers at once (a stand-in for llama-server, `serve` below), tiny requests only.

    .venv/bin/python -m bench.instant [--requests 1000] [--clients 16] [--seconds 10]
    .venv/bin/python -m bench.instant --src /tmp/before/src --out /tmp/ab.md   # A/B against another tree

Against the real llama-server a tiny request leaves the gateway idle for the ~10 ms the model takes,
and on this VM the same work costs ~3.7 x more after such a wait (cold caches, a lower clock): the
figures of `python -m bench` are mostly that factor. Here the answer comes back within a fraction of
a millisecond, so what is measured is the code, warm: the gateway CPU per tiny request one at a time,
and under `--clients` concurrent clients the requests per second one gateway process serves (its
capacity, the figure `serve --workers` multiplies) and the CPU each costs there.

llmserver starts the stand-in as its `llama_server_path` (a script that runs `python -m bench.instant
upstream` with llama-server's arguments, of which it reads --host and --port).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import uvloop

from bench import load
from bench.targets import Target, free_port, model_config, start_llmserver, start_passthrough, wait_ready

ROOT = Path(__file__).resolve().parents[1]

ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": "instant",
        "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 1,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "timings": {"prompt_ms": 0.1, "predicted_ms": 0.1},
    }
)
BODIES = {b"/health": b'{"status":"ok"}', b"/props": b'{"chat_template_caps":{}}'}


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 on one kept-alive connection: every POST gets the canned completion, a GET its body."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path, _ = head.split(b" ", 2)
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            body = ANSWER if method == b"POST" else BODIES.get(path, b"{}")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(answer, host, port)
    async with server:
        await server.serve_forever()


def upstream_script(folder: Path) -> Path:
    """An executable that llmserver runs as llama-server: the stand-in, with llama-server's arguments."""
    script = folder / "instant-llama-server"
    script.write_text(f'#!/bin/sh\ncd "{ROOT}" && exec "{sys.executable}" -m bench.instant upstream "$@"\n')
    script.chmod(0o755)
    return script


def start_upstream(script: Path, folder: Path) -> Target:
    """The stand-in as a target of its own (the pass-throughs' upstream), run by `script`."""
    port = free_port()
    with (folder / "instant.log").open("ab") as log:
        process = subprocess.Popen(
            [str(script), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    return wait_ready(Target("instant", f"http://127.0.0.1:{port}", process), "/health")


def measure(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="llmserver-instant-"))
    script = upstream_script(folder)
    upstream = start_upstream(script, folder)
    settings = f'instances.llama_server_path = "{script}"\n'
    targets = [start_passthrough(upstream, folder), start_passthrough(upstream, folder, client="wire")]
    for index, src in enumerate([str(ROOT / "src"), *args.src]):
        name = "llmserver" if index == 0 else f"llmserver-{index}"
        model = model_config(4, 2048, 1)
        targets.append(start_llmserver(model, folder, name=name, settings=settings, env={"PYTHONPATH": src}))
    rows: list[tuple[str, float, float, float, float]] = []
    try:
        load.settle()
        latencies, alone = asyncio.run(load.overhead(targets, args.requests))
        rates: dict[str, list[float]] = {target.name: [] for target in targets}
        cpus: dict[str, list[float]] = {target.name: [] for target in targets}
        for repeat in range(args.repeats):
            for target in load.turn(targets, repeat):  # each target in each place in turn
                rate, _, cpu = asyncio.run(load.capacity(target, args.clients, args.seconds))
                rates[target.name].append(rate)
                cpus[target.name].append(cpu)
        for target in targets:
            name = target.name
            p50 = statistics.median(latencies[name])
            rows.append((name, alone[name], p50, statistics.median(rates[name]), statistics.median(cpus[name])))
    finally:
        for target in [*targets, upstream]:
            target.stop()
    command = (
        f"python -m bench.instant --requests {args.requests} --clients {args.clients} --seconds {args.seconds:g} "
        f"--repeats {args.repeats}"
    )
    lines = [
        "# The gateway's own cost: tiny requests to an upstream that answers at once",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs): llmserver (SQLite, one",
        "instance: the stand-in for llama-server of bench/instant.py) and the bare pass-through on aiohttp and",
        "on llmserver's own client, all in front of the same stand-in. One at a time: the targets take turns",
        f"{load.BLOCK} requests at a time, {args.requests} each. Capacity: {args.clients} clients for "
        f"{args.seconds:g} s, the median of {args.repeats}",
        "runs, each target in each place in turn. CPU: the gateway process's own, per request.",
        "",
        f"| target | CPU per request, one at a time | p50 ms | requests/s, {args.clients} clients "
        "| CPU per request there |",
        "|---|---|---|---|---|",
    ]
    for name, cpu_alone, p50, rate, cpu in rows:
        lines.append(f"| {name} | {cpu_alone * 1000:.3f} ms | {p50 * 1000:.2f} | {rate:.0f} | {cpu * 1000:.3f} ms |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["upstream"]:  # run by llmserver (or the benchmark) as llama-server
        parser = argparse.ArgumentParser(prog="instant-llama-server")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, required=True)
        known, _ = parser.parse_known_args(sys.argv[2:])
        uvloop.run(serve(known.host, known.port))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.instant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="tiny requests one at a time, per target")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients for the capacity")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of each capacity measurement")
    parser.add_argument("--repeats", type=int, default=3, help="capacity measurements per target (median)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "instant.md")
    parser.add_argument("--src", action="append", default=[], help="another llmserver src/ tree to compare")
    measure(parser.parse_args())


if __name__ == "__main__":
    main()
