"""The hot path's cost, A/B: gateway CPU per streamed token and per tiny request for one or more
llmserver source trees, beside the bare pass-through proxy, against one shared llama-server.

    .venv/bin/python -m bench.hotpath                         # the working tree
    .venv/bin/python -m bench.hotpath --src /tmp/before/src   # ... and another tree (a git worktree)
    .venv/bin/python -m bench.hotpath --traced                # ... and the working tree with tracing on
    .venv/bin/python -m bench.hotpath --apis                  # ... and its Messages and Responses streams
    .venv/bin/python -m bench.hotpath --twin                  # ... and a second copy of the working tree

Read an A/B against the twin's figure: two processes of the same tree differ by a few percent from run
to run on a shared VM (0.04 to 0.08 ms a tiny request here), which is as large as most single changes.

Every variant runs each measurement in turn, each taking each place in the order in turn; the figures are
medians over the repeats of process CPU time divided by the work (far steadier here than wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import load
from bench.targets import Target, model_config, start_llama_server, start_llmserver, start_passthrough

ROOT = Path(__file__).resolve().parents[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(target: Target, clients: int, requests: int, max_tokens: int, api: str = "chat") -> tuple[float, float]:
    """(gateway CPU ms per streamed token, tokens/s) for `requests` streamed requests per client."""
    before = load.cpu_seconds(target)
    samples, seconds = asyncio.run(load.run_level(target, clients, requests, max_tokens, api))
    tokens = sum(s.tokens for s in samples)
    return (load.cpu_seconds(target) - before) * 1000 / tokens, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", default=[], help="another llmserver src/ tree to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", type=int, default=300, help="tiny requests per variant and repeat")
    parser.add_argument("--tiny-only", action="store_true", help="measure only the tiny requests")
    parser.add_argument(
        "--wire-floor", action="store_true", help="also the pass-through on llmserver's own client (llama/wire.py)"
    )
    parser.add_argument(
        "--twin", action="store_true",
        help="also a second copy of the working tree: the difference between identical trees in the same run",
    )  # fmt: skip
    parser.add_argument(
        "--traced", action="store_true",
        help="also the working tree with tracing on (otlp_endpoint: a local receiver that takes every span)",
    )  # fmt: skip
    parser.add_argument(
        "--apis", action="store_true",
        help="also the working tree's /v1/messages and /v1/responses streams (CPU per token beside its chat's)",
    )  # fmt: skip
    args = parser.parse_args()
    model = model_config(4, 2048, 2)
    logs = Path(tempfile.mkdtemp(prefix="llmserver-hotpath-"))
    direct = start_llama_server(model, logs)
    targets: list[Target] = []
    levels = () if args.tiny_only else ((1, 6), (8, 2))  # (clients, requests per client) of 128 tokens
    per_token: dict[tuple[str, int], list[float]] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    per_tiny: dict[str, list[float]] = {}
    added: dict[str, list[float]] = {}  # ms a tiny request's p50 is above direct llama-server's
    try:
        targets.append(start_passthrough(direct, logs))
        if args.wire_floor:
            targets.append(start_passthrough(direct, logs, client="wire"))
        for index, src in enumerate([str(ROOT / "src"), *args.src]):
            name = "llmserver" if index == 0 else f"llmserver-{index}"
            progress(f"{name}: {src}")
            targets.append(start_llmserver(model, logs, name=name, env={"PYTHONPATH": src}))
        if args.twin:
            targets.append(start_llmserver(model, logs, name="llmserver-twin", env={"PYTHONPATH": str(ROOT / "src")}))
        if args.traced:
            sink = span_sink()
            env = {
                "PYTHONPATH": str(ROOT / "src"),
                "LLMSERVER_OBSERVABILITY__OTLP_ENDPOINT": f"http://127.0.0.1:{sink}",
            }
            targets.append(start_llmserver(model, logs, name="llmserver-traced", env=env))
        for target in [direct, *targets]:
            asyncio.run(load.run_level(target, 1, 1, 16))  # warm
        for repeat in range(args.repeats):
            order = load.turn(targets, repeat)  # each target in each place in turn
            for clients, requests in levels:
                for target in [direct, *order]:
                    if target is direct:
                        _, rate = measure_direct(direct, clients, requests)
                        rates.setdefault((direct.name, clients), []).append(rate)
                        continue
                    cpu, rate = measure(target, clients, requests, 128)
                    per_token.setdefault((target.name, clients), []).append(cpu)
                    rates.setdefault((target.name, clients), []).append(rate)
                    progress(f"repeat {repeat + 1}: {target.name}, {clients} clients: {cpu:.3f} ms CPU/token")
                    if args.apis and target.name == "llmserver":
                        for api in ("messages", "responses"):
                            cpu, _ = measure(target, clients, requests, 128, api)
                            per_token.setdefault((f"llmserver {api}", clients), []).append(cpu)
                            progress(f"repeat {repeat + 1}: {api}, {clients} clients: {cpu:.3f} ms CPU/token")
            # Direct llama-server takes its turns too: each gateway's added latency is against it, in the same run.
            latencies, cpu = asyncio.run(load.overhead(load.turn([direct, *targets], repeat), args.tiny))
            direct_p50 = statistics.median(latencies[direct.name])
            for name, seconds in cpu.items():
                per_tiny.setdefault(name, []).append(seconds * 1000)
                added.setdefault(name, []).append((statistics.median(latencies[name]) - direct_p50) * 1000)
                progress(f"repeat {repeat + 1}: {name}: {seconds * 1000:.3f} ms CPU per tiny request, "
                         f"p50 +{added[name][-1]:.2f} ms")  # fmt: skip
    finally:
        for target in [*targets, direct]:
            target.stop()
    if not levels:
        for target in targets:
            print(
                f"| {target.name} | {statistics.median(per_tiny[target.name]):.3f} ms CPU per tiny request | "
                f"p50 +{statistics.median(added[target.name]):.2f} ms |"
            )
        return
    print(
        "| target | CPU ms/token, 1 client | 8 clients | CPU ms/tiny request | tiny p50 added | "
        "tok/s ratio to direct, 1 / 8 |"
    )
    print("|---|---|---|---|---|---|")
    for target in targets:
        cells = [statistics.median(per_token[target.name, c]) for c, _ in levels]
        ratios = [
            statistics.median(rates[target.name, c]) / statistics.median(rates[direct.name, c]) for c, _ in levels
        ]
        print(
            f"| {target.name} | {cells[0]:.3f} | {cells[1]:.3f} | {statistics.median(per_tiny[target.name]):.3f} | "
            f"+{statistics.median(added[target.name]):.2f} ms | "
            f"{ratios[0]:.3f} / {ratios[1]:.3f} |"
        )
    if args.apis:
        print("\n| stream | CPU ms/token, 1 client | 8 clients | ratio to chat's, 1 / 8 |\n|---|---|---|---|")
        chat = [statistics.median(per_token["llmserver", c]) for c, _ in levels]
        for api in ("messages", "responses"):
            cells = [statistics.median(per_token[f"llmserver {api}", c]) for c, _ in levels]
            print(f"| /v1/{api} | {cells[0]:.3f} | {cells[1]:.3f} | "
                  f"{cells[0] / chat[0]:.3f} / {cells[1] / chat[1]:.3f} |")  # fmt: skip


def span_sink() -> int:
    """An OTLP/HTTP receiver that answers 200 to everything (in a thread of this process): its port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1])


def measure_direct(target: Target, clients: int, requests: int) -> tuple[float, float]:
    samples, seconds = asyncio.run(load.run_level(target, clients, requests, 128))
    return 0.0, sum(s.tokens for s in samples) / seconds


if __name__ == "__main__":
    main()
