"""Conversations after their instance is gone: the next turn's time to first token with the prompt cache
restored from disk (pool/saved_prompts.py) against recomputed, and against a turn whose cache was in memory.

    python -m bench.saved_prompts [--conversations 8] [--history 1500] [--out bench/results/saved-prompts.md]

One model (the embedded one, 8 slots, so that one instance holds all 8 conversations) and a second model on
the same file whose instance does not fit beside it under `memory_budget_mb`. Each conversation's first turn
reads a history of about `--history` tokens; its second turn is the in-memory figure. Then three events, each
followed by one more turn of every conversation, measured: an eviction (the other model's request stops the
idle instance; the instance is then started again before the turns, so that its start is not counted), a
drain (DELETE /api/instances/ID; the replacement's start not counted) and a restart of the server (a clean
shutdown; the next start not counted). The same run with `prompt_cache_disk_mb = 0` gives the recomputed
figures. A turn is `max_tokens: 1`: its time is the prompt's reading. Medians over the conversations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.targets import Target, free_port, free_port_range, wait_ready
from llmserver.models.files import embedded_model_path

ADMIN = "bench-admin-key-saved-prompts-0123"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
EVENTS = ("eviction", "drain", "restart")
WORDS = ["river", "stone", "light", "paper", "garden", "window", "music", "engine", "forest", "letter", "copper"]


def config(model: Path, budget_mb: int, disk_mb: int) -> str:
    return f"""instances.memory_budget_mb = {budget_mb}
prompt_cache.disk_mb = {disk_mb}

[[models]]
name = "chat"
path = "{model}"
parallel = 8
ctx_size = 2048
threads = 2
min_instances = 1
max_instances = 1

[[models]]
name = "other"
path = "{model}"
parallel = 1
ctx_size = 32768
threads = 2
min_instances = 0
max_instances = 1
"""


def history(seed: int, tokens: int) -> list[dict[str, str]]:
    """A conversation of about `tokens` tokens (a word here is about 1.3), its own from the start."""
    messages = [{"role": "system", "content": f"Conversation {seed}. You answer in one word."}]
    turn, words = 0, 0
    while words * 1.3 < tokens:
        text = " ".join(WORDS[(seed * 7 + turn * 3 + n) % len(WORDS)] for n in range(60))
        messages += [{"role": "user", "content": f"Log {turn}: {text}"}, {"role": "assistant", "content": "Noted."}]
        turn, words = turn + 1, words + 64
    return messages


@dataclass
class Run:
    disk_mb: int
    in_memory: list[float] = field(default_factory=list)
    after: dict[str, list[float]] = field(default_factory=dict)
    cached: dict[str, list[int]] = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)
    disk_bytes: int = 0
    last_tokens: list[int] = field(default_factory=list)  # each conversation's prompt at its last turn


class Server:
    def __init__(self, data_dir: Path, logs: Path) -> None:
        self.data_dir, self.logs = data_dir, logs
        self.target: Target | None = None

    def start(self) -> None:
        port = free_port()
        env = {**os.environ, "LLMSERVER_ADMIN_KEY": ADMIN}
        env["LLMSERVER_INSTANCES__BASE_PORT"] = str(free_port_range(4, avoid=port))
        with (self.logs / "saved-prompts.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "llmserver", "serve", "--config", str(self.data_dir / "config.toml"),
                 "--data-dir", str(self.data_dir), "--port", str(port), "--log-level", "info"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.target = wait_ready(Target("llmserver", f"http://127.0.0.1:{port}", process, HEADERS), "/ready", 300)

    @property
    def url(self) -> str:
        assert self.target is not None
        return self.target.url

    def stop(self) -> None:
        if self.target is not None:
            self.target.stop()

    def instances(self, model: str) -> list[dict[str, object]]:
        listed = httpx.get(self.url + "/api/instances", headers=HEADERS, timeout=30).json()["data"]
        return [i for i in listed if i["model"] == model and i["status"] in ("ready", "busy")]

    def wait_instance(self, model: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.instances(model):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {model} instance within {timeout:.0f} s")
            time.sleep(0.2)

    def start_chat(self) -> None:
        """Chat's instance started now (the other model's, idle, leaves no room for min_instances to)."""
        httpx.post(self.url + "/api/instances", headers=HEADERS, json={"model": "chat"}, timeout=600)
        self.wait_instance("chat")

    def turn(self, messages: list[dict[str, str]], model: str = "chat") -> tuple[float, dict[str, object]]:
        started = time.perf_counter()
        answer = httpx.post(
            self.url + "/v1/chat/completions",
            headers=HEADERS,
            json={"model": model, "messages": messages, "max_tokens": 1, "temperature": 0},
            timeout=600,
        )
        seconds = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {answer.text}")
        return seconds, answer.json()["usage"]


def conversation_turns(server: Server, talks: list[list[dict[str, str]]], turn: int, run: Run) -> list[float]:
    """Every conversation's next turn: their seconds; their prompt and cached tokens noted in `run`."""
    seconds, cached, run.last_tokens = [], [], []
    for messages in talks:
        messages.append({"role": "user", "content": f"Question {turn}: which word came first?"})
        took, usage = server.turn(messages)
        seconds.append(took)
        cached.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))  # type: ignore[attr-defined]
        run.last_tokens.append(int(usage["prompt_tokens"]))  # type: ignore[call-overload]
        messages.append({"role": "assistant", "content": "River."})
    run.cached[f"turn {turn}"] = cached
    return seconds


def measure(conversations: int, tokens: int, disk_mb: int, logs: Path) -> Run:
    run = Run(disk_mb)
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-saved-"))
    # The other model's 32k-token context takes more than the budget leaves beside "chat".
    (data_dir / "config.toml").write_text(config(embedded_model_path(), 900, disk_mb))
    server = Server(data_dir, logs)
    server.start()
    try:
        talks = [history(seed, tokens) for seed in range(conversations)]
        for messages in talks:  # the first turns, uncounted: each reads its whole history
            messages.append({"role": "user", "content": "Question 0: which word came first?"})
            _, usage = server.turn(messages)
            run.prompt_tokens.append(int(usage["prompt_tokens"]))  # type: ignore[call-overload]
            messages.append({"role": "assistant", "content": "River."})
        run.in_memory = conversation_turns(server, talks, 1, run)
        for number, event in enumerate(EVENTS, start=2):
            if event == "eviction":
                server.turn([{"role": "user", "content": "Hello."}], model="other")  # stops chat's idle instance
                assert not server.instances("chat"), "the other model's start did not evict chat's instance"
                server.start_chat()
            elif event == "drain":
                (instance,) = server.instances("chat")
                httpx.delete(f"{server.url}/api/instances/{instance['instance_id']}", headers=HEADERS, timeout=600)
                server.start_chat()
            else:
                server.stop()
                server.start()
                server.wait_instance("chat")
            run.after[event] = conversation_turns(server, talks, number, run)
            run.cached[event] = run.cached.pop(f"turn {number}")
        files = list((data_dir / "prompt-cache").glob("*/*/*.slot"))
        run.disk_bytes = sum(path.stat().st_size for path in files)
    finally:
        server.stop()
    return run


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f}"


def compare(conversations: int, tokens: int, logs: Path) -> tuple[Run, Run]:
    """The workload with saving on, then off: (restored, recomputed)."""
    return measure(conversations, tokens, 4096, logs), measure(conversations, tokens, 0, logs)


def report(restored: Run, recomputed: Run, conversations: int, level: str = "#") -> str:
    memory = statistics.median(restored.in_memory + recomputed.in_memory)
    lines = [
        f"{level} Conversations after their instance is gone: restored or recomputed",
        "",
        f"`python -m bench.saved_prompts`: {conversations} conversations of "
        f"{statistics.median(restored.prompt_tokens):,.0f} prompt tokens (median) on one instance of the "
        "embedded model (8 slots, 2 threads); after each event, every conversation's next turn "
        "(`max_tokens: 1`), medians in ms. In memory: the turn before any event "
        f"({ms(restored.in_memory + recomputed.in_memory)} ms).",
        "",
        "| event | in memory | restored | recomputed | restored / in memory | recomputed / in memory |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for event in EVENTS:
        back, again = statistics.median(restored.after[event]), statistics.median(recomputed.after[event])
        lines.append(
            f"| {event} | {memory * 1000:,.0f} | {back * 1000:,.0f} | {again * 1000:,.0f} | "
            f"{back / memory:.1f} x | {again / memory:.1f} x |"
        )
    share = [min(c) / p for event in EVENTS for c, p in [(restored.cached[event], min(restored.prompt_tokens))]]
    per_thousand = restored.disk_bytes / sum(restored.last_tokens) * 1000 / 2**20
    lines += [
        "",
        f"Tokens from the cache on the turns after an event, restored: at least {min(share):.0%} of the first "
        f"prompt's; recomputed: {max(max(recomputed.cached[e]) for e in EVENTS)} tokens at most.",
        f"Disk: {restored.disk_bytes / 2**20:,.0f} MiB for {conversations} conversations, about "
        f"{per_thousand:.1f} MiB per 1,000 tokens of history (the KV state, f16, of this 135M model).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--history", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="llmserver-bench-logs-"))
    restored, recomputed = compare(args.conversations, args.history, logs)
    text = report(restored, recomputed, args.conversations)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
