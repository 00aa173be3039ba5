"""Fair shares bounded in time: another key's short request while one key's long streams hold every slot.

    python -m bench.fairness [--streams 16] [--slots 4] [--shortest 400] [--longest 1200] [--probes 5]
                             [--slices 0 2] [--out bench/results/fairness.md]

One gateway in front of one instance of the embedded model with `--slots` slots (2 threads). A heavy key
opens `--streams` streamed completions at once, each counting ("1, 2, 3, 4," → " 5, 6, …") to its own
max_tokens, spread evenly from `--shortest` to `--longest`. Once every slot generates, a light key sends
`--probes` tiny requests (max_tokens 4), one after another, each timed from send to answer. Per
`limits.fair_slice` setting (`--slices`, seconds; 0: a request keeps its slot to its end), on a fresh server:
the light key's latency (median and worst; `limits.queue_timeout` is 900 s here, so that the heavy key's
own backlog is not cut, and a wait past the default 60 s shows as what it is), the heavy streams' tokens
per second and whole time, and whether every heavy stream got every token it asked for, its count
unbroken (a stream that gave its slot back and went on must lose nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.tenants import Gateway
from llmserver.models.files import embedded_model_path

COUNT_FROM = "1, 2, 3, 4,"


@dataclass
class Result:
    fair_slice: float
    probes: list[float] = field(default_factory=list)  # seconds, None-free: refused probes are in `refused`
    refused: list[int] = field(default_factory=list)  # status codes of probes that failed
    tokens: int = 0  # the heavy streams' completion tokens, all of them
    seconds: float = 0.0  # from the first heavy stream's send to the last one's end
    whole: int = 0  # heavy streams with every token they asked for and an unbroken count
    yields: float = 0.0  # llmserver_slot_yields_total at the end


def config(slots: int, fair_slice: float) -> str:
    # The heavy key's own backlog waits longer than the default 60 s for its slots: not what is measured.
    return f"""limits.fair_slice = {fair_slice}
limits.queue_timeout = 900

[[models]]
name = "chat"
path = "{embedded_model_path()}"
parallel = {slots}
ctx_size = {slots * 4096}
threads = 2
min_instances = 1
max_instances = 1
"""


def unbroken(text: str) -> bool:
    """Whether `text` continues the count with no gap and no repeat (its last number may be cut short)."""
    numbers = [part.strip() for part in (COUNT_FROM + text).split(",")]
    numbers = [n for n in numbers if n]
    whole, last = numbers[:-1], numbers[-1]
    expected = [str(n) for n in range(1, len(numbers) + 1)]
    return whole == expected[:-1] and expected[-1].startswith(last)


async def heavy_stream(client: httpx.AsyncClient, key: str, max_tokens: int, result: Result) -> None:
    body = {"model": "chat", "prompt": COUNT_FROM, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text: list[str] = []
    usage: dict[str, int] = {}
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                text.append(choice.get("text") or "")
            usage = event.get("usage") or usage
    generated = int(usage.get("completion_tokens", 0))
    result.tokens += generated
    if generated == max_tokens and unbroken("".join(text)):
        result.whole += 1


async def metric(client: httpx.AsyncClient, admin: dict[str, str], name: str) -> float:
    """A metric's value summed over its labels."""
    text = (await client.get("/metrics", headers=admin)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def measure(
    fair_slice: float, streams: int, slots: int, shortest: int, longest: int, probes: int, logs: Path
) -> Result:
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-fairness-"))
    (data_dir / "config.toml").write_text(config(slots, fair_slice))
    gateway = Gateway(data_dir, logs / "fairness.log")
    result = Result(fair_slice)
    try:
        heavy, light = gateway.key("heavy"), gateway.key("light")
        admin = dict(gateway.target.headers)
        steps = max(1, streams - 1)
        lengths = [shortest + (longest - shortest) * n // steps for n in range(streams)]

        async def run() -> None:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=900) as client:
                started = time.perf_counter()
                tasks = [asyncio.create_task(heavy_stream(client, heavy, n, result)) for n in lengths]
                for _ in range(3000):  # every slot taken (5 minutes at most)
                    if await metric(client, admin, "llmserver_in_flight") >= min(streams, slots):
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(2.0)  # every slot well into its generation
                for _ in range(probes):
                    sent = time.perf_counter()
                    answer = await client.post(
                        "/v1/completions", json={"model": "chat", "prompt": "Hello", "max_tokens": 4},
                        headers={"Authorization": f"Bearer {light}"},
                    )  # fmt: skip
                    if answer.status_code == 200:
                        result.probes.append(time.perf_counter() - sent)
                    else:
                        result.refused.append(answer.status_code)
                await asyncio.gather(*tasks)
                result.seconds = time.perf_counter() - started
                result.yields = await metric(client, admin, "llmserver_slot_yields_total")

        asyncio.run(run())
    finally:
        gateway.target.stop()
    return result


def report(results: list[Result], streams: int, slots: int, shortest: int, longest: int, level: str = "#") -> str:
    lines = [
        f"{level} Another key's request behind one key's long streams",
        "",
        f"`python -m bench.fairness`: one key's {streams} streamed completions (max_tokens {shortest} to {longest}, "
        f"every one counting to its end) on one instance of the embedded model with {slots} slots (2 threads); "
        "once every slot generates, another key's tiny requests (max_tokens 4), one after another.",
        "",
        "| limits.fair_slice | light key's request: median / worst | answered | heavy streams: tokens/s | "
        "heavy streams' whole time | heavy streams whole and unbroken | slots given back |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        latency = f"{statistics.median(r.probes):.2f} s / {max(r.probes):.2f} s" if r.probes else "none answered"
        answered = f"{len(r.probes)} of {len(r.probes) + len(r.refused)}"
        if r.refused:
            answered += f" ({', '.join(str(code) for code in r.refused)})"
        lines.append(
            f"| {r.fair_slice:g} s | {latency} | {answered} | {r.tokens / r.seconds:.1f} | {r.seconds:.1f} s | "
            f"{r.whole} of {streams} | {r.yields:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=400)
    parser.add_argument("--longest", type=int, default=1200)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--slices", type=float, nargs="*", default=[0.0, 2.0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    results = [
        measure(s, args.streams, args.slots, args.shortest, args.longest, args.probes, logs) for s in args.slices
    ]
    text = report(results, args.streams, args.slots, args.shortest, args.longest)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
