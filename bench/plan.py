"""What one benchmark run does (its plan: quick or full) and what it measured (its results), read by
bench/run.py, which fills them, and bench/report.py, which writes them out."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench import affinity as affinity_workload
from bench import load


@dataclass
class Plan:
    mode: str
    levels: list[int]
    per_client: int  # streamed requests per client in one block
    min_requests: int  # per target and level, in all its blocks: few clients run more blocks
    repeats: int  # blocks per target and level at least; rounds of the tiny-request capacity
    max_tokens: int
    overhead_requests: int
    capacity_levels: list[int]
    capacity_seconds: float
    conversations: int  # prompt-cache affinity: conversations of `turns` turns, on two instances
    turns: int
    saved_conversations: int  # saved prompt caches (bench/saved_prompts.py): conversations of `saved_history` tokens
    saved_history: int
    parallel: int = 4
    ctx_size: int = 2048
    threads: int = 2
    warm_tokens: int = 32  # a warm-up request's tokens: enough to run every slot the level uses


# The quick run is a smoke test of the harness (its figures are not read): a warm-up of a few tokens, short
# capacity runs, one conversation after each of the three events.
QUICK = Plan("quick", [1, 4, 16], 1, 1, 1, 32, 60, [1, 4], 1.5, 2, 2, 1, 300, warm_tokens=4)
FULL = Plan("full", [1, 4, 8, 16], 3, 24, 2, 128, 400, [1, 2, 4, 8, 16], 8.0, 4, 6, 8, 1500)


@dataclass
class Results:
    plan: Plan
    targets: list[str]
    levels: dict[str, dict[int, load.LevelResult]] = field(default_factory=dict)
    overhead: dict[str, list[float]] = field(default_factory=dict)
    overhead_cpu: dict[str, float] = field(default_factory=dict)  # gateway CPU seconds per tiny request
    # (clients, requests/s, median latency, gateway CPU seconds per request) by target
    capacity: dict[str, list[tuple[int, float, float, float]]] = field(default_factory=dict)
    rss_idle: int = 0
    rss_peak: int = 0
    affinity: dict[str, affinity_workload.Later] = field(default_factory=dict)
    saved_prompts: str = ""  # its report section (bench/saved_prompts.py)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
