"""The workload: streamed chat requests at a fixed concurrency, and tiny non-streamed ones.

Every request is timed on the client: time to first token (the first content chunk), the gaps
between content chunks (inter-token latencies), end-to-end latency and the output tokens the
server reports. Prompts are fixed and decoding is greedy, so every target generates the same
tokens and the same lengths.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from bench.targets import Target

PROMPTS = (
    "Count from 1 to 1000, separated by commas.",
    "List the numbers from 500 to 1500, one per line.",
    "Write the alphabet again and again, letters separated by spaces.",
    "Count backwards from 2000 to 1, separated by commas.",
)


@dataclass
class Sample:
    ttft: float
    itls: list[float]
    latency: float
    tokens: int


@dataclass
class LevelResult:
    target: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the runs, summed
    cpu_seconds: float = 0.0  # a gateway's process CPU time during the runs, summed
    blocks: list[float] = field(default_factory=list)  # tokens/s of each block, in the order run

    @property
    def cpu_ms_per_token(self) -> float:
        return self.cpu_seconds * 1000 / self.tokens if self.tokens else float("nan")

    @property
    def tokens(self) -> int:
        return sum(sample.tokens for sample in self.samples)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_second(self) -> float:
        return len(self.samples) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def chat_body(target: Target, prompt: str, max_tokens: int, *, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# The streaming APIs a run can measure (llmserver's; llama-server and the pass-throughs speak chat only):
# each one's path, its request body, whether an event is a piece of the answer's text, and its count.
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def api_body(api: str, target: Target, prompt: str, max_tokens: int) -> dict[str, object]:
    if api == "chat":
        return chat_body(target, prompt, max_tokens, stream=True)
    body: dict[str, object] = {"model": target.model, "temperature": 0, "stream": True}
    if api == "messages":
        return {**body, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return {**body, "input": prompt, "max_output_tokens": max_tokens}


def _text_and_count(api: str, event: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether an event carries answer text, and the completion's token count if it tells it."""
    if api == "chat":
        choices = event.get("choices") or []
        usage = event.get("usage")
        text = bool(choices and (choices[0].get("delta") or {}).get("content"))
        return text, int(usage.get("completion_tokens") or 0) if usage else None
    if api == "messages":
        if event.get("type") == "message_delta":
            return False, int(event["usage"].get("output_tokens") or 0)
        return event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta", None
    if event.get("type") in ("response.completed", "response.incomplete"):
        return False, int((event["response"].get("usage") or {}).get("output_tokens") or 0)
    return event.get("type") == "response.output_text.delta", None


async def streamed(
    session: aiohttp.ClientSession, target: Target, prompt: str, max_tokens: int, api: str = "chat"
) -> Sample:
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    body = api_body(api, target, prompt, max_tokens)
    async with post(session, target, body, API_PATHS[api]) as response:
        if response.status != 200:
            raise RuntimeError(f"{target.name} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                continue  # read on to the end, so the connection is reused only when the server allows it
            text, count = _text_and_count(api, json.loads(data))
            if text:
                arrivals.append(time.perf_counter())
            if count:
                tokens = count
    finished = time.perf_counter()
    if not arrivals:
        raise RuntimeError(f"{target.name} streamed no content")
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return Sample(arrivals[0] - started, gaps, finished - started, tokens or len(arrivals))


async def tiny(session: aiohttp.ClientSession, target: Target) -> float:
    """One max_tokens=1 non-streamed request: its latency."""
    started = time.perf_counter()
    body = chat_body(target, "Hi", 1, stream=False)
    async with post(session, target, body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{target.name} answered {response.status}")
    return time.perf_counter() - started


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=900))


RESENT: collections.Counter[str] = collections.Counter()


RESEND_LIMIT = 50


@asynccontextmanager
async def post(
    client: aiohttp.ClientSession, target: Target, body: dict[str, object], path: str = API_PATHS["chat"]
) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST a chat request, sent again while the connection is dropped before any answer: plain
    llama-server closes connections beyond its HTTP threads (parallel + 4). The time of every try
    counts in the request's latency, as it would for a client of that server."""
    for attempt in range(1, RESEND_LIMIT + 1):
        try:
            response = await client.post(target.url + path, json=body, headers=target.headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt == RESEND_LIMIT:
                raise
            RESENT[target.name] += 1
            await asyncio.sleep(0.01)
            continue
        try:
            yield response
        finally:
            response.release()
        return


async def run_level(
    target: Target, concurrency: int, per_client: int, max_tokens: int, api: str = "chat"
) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending `per_client` streamed requests back to back (to `api`)."""
    async with session() as client:

        async def worker(index: int) -> list[Sample]:
            return [
                await streamed(client, target, PROMPTS[(index + i) % len(PROMPTS)], max_tokens, api)
                for i in range(per_client)
            ]

        started = time.perf_counter()
        results = await asyncio.gather(*(worker(i) for i in range(concurrency)))
        seconds = time.perf_counter() - started
    return [sample for samples in results for sample in samples], seconds


# A target's tiny requests come in runs of this many: a gateway serves its own requests one after
# another, while taking turns request by request put two other proxies' work between each two of a
# target's requests and made every target run colder than it would in use (measured: llmserver 1.53
# against 1.01 ms of CPU a request, the aiohttp pass-through 1.01 against 0.70; their ratio the same).
BLOCK = 25


async def overhead(
    targets: list[Target], count: int, block: int = BLOCK
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Tiny requests one at a time, the targets taking turns `block` requests at a time: their
    latencies, and each gateway's CPU time per request."""
    latencies: dict[str, list[float]] = {target.name: [] for target in targets}
    async with session() as client:
        for target in targets:  # warm: connections, prompt cache
            for _ in range(3):
                await tiny(client, target)
        before = {target.name: cpu_seconds(target) for target in targets if target.gateway}
        for i in range(-(-count // block)):
            # Every target in every place and after every other in turn: a target always second was
            # measured 0.15 ms of CPU a request dearer than its identical twin always third.
            for target in turn(targets, i):
                for _ in range(min(block, count - i * block)):
                    latencies[target.name].append(await tiny(client, target))
        cpu = {target.name: (cpu_seconds(target) - before[target.name]) / count for target in targets if target.gateway}
    return latencies, cpu


def turn(targets: list[Target], i: int) -> list[Target]:
    """The i-th order of the targets, in pairs: the rotation by i // 2, forwards and then backwards.
    Each pair gives every target the same mean place, so that a drift of the machine's speed over
    the pair falls alike on all of them (two rotations by one did not: a target first and then last
    ran at both ends of the drift, the one after it in the middle), and each target takes each
    place in turn as the pairs go on."""
    shift = (i // 2) % len(targets)
    ordered = targets[shift:] + targets[:shift]
    return ordered if i % 2 == 0 else ordered[::-1]


async def capacity(target: Target, concurrency: int, seconds: float) -> tuple[float, float, float]:
    """Tiny requests from `concurrency` clients for `seconds`: requests/s, median latency and (for a
    gateway) its CPU seconds per request."""
    latencies: list[float] = []
    before = cpu_seconds(target) if target.gateway else 0.0
    async with session() as client:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                latencies.append(await tiny(client, target))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    cpu = (cpu_seconds(target) - before) / len(latencies) if target.gateway else float("nan")
    return len(latencies) / elapsed, statistics.median(latencies), cpu


def settle(quiet_percent: float = 10.0, most_seconds: float = 60.0) -> float:
    """Wait until the CPU use over a second of the CPUs this process may run on (and the targets it
    starts, which inherit its affinity) is below `quiet_percent` (at most `most_seconds`): what the
    targets do on their own after starting is not what we measure. The last second's use. A run kept
    to some CPUs (a test worker's, `taskset`) does not wait for what runs on the others."""
    deadline = time.monotonic() + most_seconds
    busy = _own_cpus_busy()
    while busy >= quiet_percent and time.monotonic() < deadline:
        busy = _own_cpus_busy()
    return busy


def _own_cpus_busy() -> float:
    """The mean use over the next second of the CPUs this process may run on."""
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_cpu = psutil.cpu_percent(interval=1.0, percpu=True)
    mine = [per_cpu[cpu] for cpu in own if cpu < len(per_cpu)] or per_cpu
    return sum(mine) / len(mine)


def cpu_seconds(target: Target) -> float:
    """The target's process CPU time (user + system), without its children's: for a gateway, what
    it spends itself. Far steadier here than wall-clock differences. On Linux read from the process's
    CPU clock, to the nanosecond (/proc counts it in 10 ms ticks: too coarse for a few hundred tokens)."""
    if sys.platform == "linux":
        return time.clock_gettime((~target.pid << 3) | 2)  # the kernel's CPUCLOCK_SCHED clock of a pid
    times = psutil.Process(target.pid).cpu_times()
    return float(times.user + times.system)


class RSSSampler:
    """The peak resident memory of one process, sampled every 0.1 s in a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RSSSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
