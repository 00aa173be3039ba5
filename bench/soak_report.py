"""The soak run's report: its counters, what the traffic got, the faults, and two charts (the
gateway's RSS and open file descriptors over time; answers per 10 s by outcome)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from bench.report import _machine


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Soak and chaos run",
        "",
        f"`python -m bench.soak {'--cluster ' if result.get('cluster') else ''}--minutes {result['minutes']:g} "
        f"--interval {result['interval']:g} --clients {result['workers']}`",
        *(
            [
                "",
                "Two gateways (role `gateway`) on a private PostgreSQL and Redis, two `llmserver node`s running the "
                "instances (the text model and the vision model on each), every request sent to either gateway.",
            ]
            if result.get("cluster")
            else []
        ),
        "",
        *_machine(),
        "",
        "## Counters (each must be 0)",
        "",
        "| counter | count |",
        "|---|---|",
        *(f"| {name} | {count} |" for name, count in result["counters"].items()),
        "",
        f"{result['requests']} requests in all; {result['generating answered']} generating requests answered, "
        f"{result['ledger rows']} ledger rows. {result['refused while restarting']} requests were sent while the "
        "gateway was stopping or starting and refused at the socket (not accepted; a load balancer retries them "
        f"elsewhere). {result.get('held by a gateway killed -9', 0)} requests were held by a gateway when it was "
        f"killed with -9 (no server can answer those); {result.get('answers just before a kill -9', 0)} answers "
        "came in the last second before such a kill, and "
        f"{result.get('ledger rows lost to a kill -9', 0)} ledger rows are missing (a gateway writes them in "
        "batches of 0.2 s; the quota settlements are written before each answer ends). "
        f"{result.get('refused while the shared state was unreachable', 0)} requests got 503 while PostgreSQL "
        "or Redis was stopped (not accepted: no ledger row); files a gateway killed -9 left in its TMPDIR: "
        f"{', '.join(result.get('files left by a gateway killed -9', [])) or 'none'}. The quota key: limit "
        "{limit} tokens, {used} settled, {ledger} in its ledger rows. Async jobs by "
        "final state: {jobs}; webhook deliveries: {hooks}.".format(
            **result["quota"],
            jobs=", ".join(f"{state} {n}" for state, n in sorted(result["jobs"].items())) or "none",
            hooks=result["webhook deliveries"],
        ),
        *_team_budget(result),
        *_ledger_difference(result),
        "",
        "## What the traffic got",
        "",
        "| scenario | outcomes |",
        "|---|---|",
        *(
            f"| {scenario} | " + ", ".join(f"{outcome}: {n}" for outcome, n in sorted(outcomes.items())) + " |"
            for scenario, outcomes in result["outcomes"].items()
        ),
        "",
        "Error answers, by message:",
        "",
        "| count | status and message |",
        "|---|---|",
        *(f"| {n} | {message} |" for message, n in result["messages"]),
        "",
        "## Faults",
        "",
        "| at (s) | fault | result |",
        "|---|---|---|",
        *(
            f"| {fault['at'] - result['samples'][0]['at']:.0f} | {fault['kind']} | {fault['detail']} |"
            for fault in result["faults"]
        ),
        "",
        "## Gateway memory and file descriptors",
        "",
        "Per gateway process (a restart starts a new one); warm = median of the quarter after the first 40% of "
        "its life, end = median of its last quarter.",
        "",
        "| process | seconds | RSS warm → end (max), MB | fds warm → end (max) |",
        "|---|---|---|---|",
        *(
            f"| {g['incarnation']} | {g['seconds']:.0f} | {g['rss_warm']:.1f} → {g['rss_end']:.1f} "
            f"({g['rss_max']:.1f}) | {g['fds_warm']:.0f} → {g['fds_end']:.0f} ({g['fds_max']:.0f}) |"
            for g in result["growth"]
        ),
        "",
        "![gateway RSS and fds](soak_resources.png)",
        "",
        "![answers by outcome](soak_outcomes.png)",
        "",
    ]
    return "\n".join(lines)


def charts(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    if not samples:
        return
    origin = samples[0]["at"]
    figure, (rss_axis, fd_axis) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for incarnation in sorted({s["incarnation"] for s in samples}):
        series = [s for s in samples if s["incarnation"] == incarnation]
        times = [(s["at"] - origin) / 60 for s in series]
        rss_axis.plot(times, [s["rss_mb"] for s in series], color="tab:blue")
        fd_axis.plot(times, [s["fds"] for s in series], color="tab:orange")
    for fault in result["faults"]:
        for axis in (rss_axis, fd_axis):
            axis.axvline(
                (fault["at"] - origin) / 60, color="grey", alpha=0.25 if fault["kind"] != "restart_gateway" else 0.8
            )
    rss_axis.set_ylabel("gateway RSS (MB)")
    fd_axis.set_ylabel("open fds")
    fd_axis.set_xlabel("minutes (grey: faults; dark: gateway restarts)")
    rss_axis.set_ylim(bottom=0)
    fd_axis.set_ylim(bottom=0)
    figure.tight_layout()
    figure.savefig(out / "soak_resources.png", dpi=90)
    plt.close(figure)

    buckets: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for started, outcome in result["calls"]:
        kind = (
            "ok" if outcome == "200"
            else "left mid-stream" if outcome == "left mid-stream"
            else "refused (restarting)" if outcome.startswith("refused")
            else "unanswered" if outcome == "unanswered"
            else "5xx or error event" if outcome.startswith(("5", "200 +"))
            else "4xx"
        )  # fmt: skip
        buckets[kind][int((started - origin) // 10)] += 1
    figure, axis = plt.subplots(figsize=(9, 3.5))
    width = max((max(b) for b in buckets.values() if b), default=0) + 1
    bottom = [0] * width
    for kind in ("ok", "4xx", "5xx or error event", "left mid-stream", "refused (restarting)", "unanswered"):
        heights = [buckets[kind][i] for i in range(width)]
        axis.bar([i * 10 / 60 for i in range(width)], heights, width=10 / 60, bottom=bottom, label=kind, align="edge")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.set_xlabel("minutes")
    axis.set_ylabel("requests per 10 s")
    axis.legend(fontsize=7, ncols=3)
    figure.tight_layout()
    figure.savefig(out / "soak_outcomes.png", dpi=90)
    plt.close(figure)


def _team_budget(result: dict[str, Any]) -> list[str]:
    """The team's budget in money, as its two keys raced for it (soaks before it have none)."""
    team = result.get("team budget")
    if not team:
        return []
    return [
        "",
        f"The team's budget: {team['budget']:.2f} in total, {team['spent']:.9f} spent by its counter and "
        f"{team['ledger cost']:.9f} in its keys' {team['ledger rows']} ledger rows, "
        f"{team['reserved after the stop']:.9f} still held after the stop; {team['refused']} of its requests "
        "refused for the budget.",
    ]


def _ledger_difference(result: dict[str, Any]) -> list[str]:
    """When the ledger rows and the answers differ: both by outcome and by key, to tell which."""
    if not result["counters"].get("ledger rows ≠ requests answered"):
        return []
    details = result.get("details", {})
    lines = ["", "| ledger rows ≠ answers, by | ledger rows | answered requests |", "|---|---|---|"]
    for by in ("outcome", "key"):
        rows, answered = details.get(f"ledger rows by {by}", {}), details.get(f"answered requests by {by}", {})
        for name in sorted(set(rows) | set(answered)):
            if rows.get(name, 0) != answered.get(name, 0):
                lines.append(f"| {by} {name} | {rows.get(name, 0)} | {answered.get(name, 0)} |")
    return lines
