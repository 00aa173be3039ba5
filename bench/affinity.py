"""The prompt-cache affinity workload: conversations with system prompts of their own, in lockstep.

Each conversation's system prompt (about 600 tokens) is its own, so only the instance that served
its earlier turns holds its prefix. Turn t of every conversation is sent at once, in a shuffled
order (clients arrive in any order); what is measured is the turns after the first: their time to
first token (`max_tokens: 1`, so the whole request is the prompt's processing) and the share of
their prompt tokens that the instance took from its cache (`usage.prompt_tokens_details`).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from llmserver.pool.affinity import Candidate, affinity_key, ranked

WORDS = [
    "river",
    "stone",
    "light",
    "paper",
    "garden",
    "window",
    "music",
    "engine",
    "forest",
    "letter",
    "copper",
    "winter",
    "market",
    "signal",
]
QUESTION = "Question {t}: which word comes first?"


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return "You answer questions about this log.\n" + " ".join(rng.choice(WORDS) for _ in range(500))


def balanced_systems(model: str, addresses: Sequence[str], count: int, first_seed: int = 0) -> list[str]:
    """System prompts of `count` conversations whose homes (pool/affinity.py) split evenly over the
    instances, as many conversations do on average; an uneven split is the load guard's business.
    Runs that must not find each other's prompts in the instances' caches start at other seeds."""
    candidates = [Candidate(address, 0, 1) for address in addresses]
    per_home = dict.fromkeys(addresses, 0)
    chosen: list[str] = []
    for seed in range(first_seed, first_seed + 10_000):
        system = system_prompt(seed)
        home = ranked(affinity_key(model, system, QUESTION.format(t=1)), candidates)[0].address
        if per_home[home] < count // len(addresses):
            per_home[home] += 1
            chosen.append(system)
            if len(chosen) == count:
                return chosen
    raise RuntimeError("no even split found")


def instance_addresses(url: str, admin_key: str) -> list[str]:
    listed = httpx.get(url + "/api/instances", headers={"Authorization": f"Bearer {admin_key}"}).json()["data"]
    return [f"{i['host']}:{i['port']}" for i in listed]


@dataclass
class Later:
    """The turns after the first, of every conversation."""

    seconds: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Turns that found less than half their prompt cached: (turn, conversation, instance, cached, prompt).
    misses: list[tuple[int, int, str, int, int]] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1000

    @property
    def mean_ms(self) -> float:
        return statistics.mean(self.seconds) * 1000

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def converse(urls: str | Sequence[str], headers: dict[str, str], systems: Sequence[str], turns: int) -> Later:
    """The workload through one server, or several (turn t through the t-th, round the list)."""
    servers = [urls] if isinstance(urls, str) else list(urls)
    histories = [[{"role": "system", "content": s}] for s in systems]
    arrival = random.Random(7)
    later = Later()
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:

        async def turn(history: list[dict[str, str]], t: int) -> tuple[float, dict[str, object], str]:
            history.append({"role": "user", "content": QUESTION.format(t=t)})
            started = time.perf_counter()
            answer = await client.post(
                servers[t % len(servers)] + "/v1/chat/completions",
                json={"messages": history, "max_tokens": 1, "temperature": 0},
            )
            took = time.perf_counter() - started
            answer.raise_for_status()
            reply = answer.json()
            history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            return took, reply["usage"], answer.headers.get("x-llmserver-instance", "")

        for t in range(1, turns + 1):
            order = arrival.sample(histories, len(histories))
            answers = await asyncio.gather(*(turn(history, t) for history in order))
            for history, (took, usage, instance) in zip(order, answers, strict=True):
                if t > 1:
                    prompt = int(usage["prompt_tokens"])  # type: ignore[call-overload]
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens", 0))  # type: ignore[union-attr]
                    later.seconds.append(took)
                    later.prompt_tokens += prompt
                    later.cached_tokens += cached
                    if cached < prompt / 2:
                        later.misses.append((t, histories.index(history), instance, cached, prompt))
    return later
