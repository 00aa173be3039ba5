"""The 2-minute soak-and-chaos run (bench/soak.py): mixed traffic under faults, every loss counter 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_two_minute_soak_loses_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", "2", "--check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["counters"] and not any(summary["counters"].values())
    # Every kind of fault happened, the server answered again after each (a counter above, whatever the
    # machine's speed), and the traffic was real: answers, refusals and jobs.
    assert {fault["kind"] for fault in summary["faults"]} == {
        "kill_instance", "leave_burst", "fill_queue", "restart_gateway"
    }  # fmt: skip
    assert "faults not followed by an answer" in summary["counters"]
    assert summary["generating answered"] > 0 and summary["ledger rows"] == summary["generating answered"]
    outcomes = summary["outcomes"]
    assert (
        "429 insufficient_quota" in outcomes["quota"]
        and outcomes["image"].get("200")
        and outcomes["documents"].get("200")
    )
    # The team's two keys spent its budget and were refused past it, the counter exact (the counters above).
    team = summary["team budget"]
    assert "429 insufficient_quota" in outcomes["team"] and team["refused"] > 0
    assert team["spent"] == pytest.approx(team["ledger cost"], abs=1e-6) and team["spent"] <= team["budget"]
    assert any(outcome.startswith("429") for outcome in outcomes["rpm"])
    assert summary["jobs"].get("ready", 0) > 0 and summary["webhook deliveries"] > 0
    for chart in ("soak_resources.png", "soak_outcomes.png"):
        assert (tmp_path / chart).read_bytes().startswith(b"\x89PNG")


def test_two_minute_cluster_soak_loses_nothing(tmp_path: Path) -> None:
    """The same across two gateways on PostgreSQL + Redis and two nodes, with every fault of shared state
    (issue 39): PostgreSQL and Redis restarted, a node and a gateway killed -9."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--cluster", "--minutes", "2", "--interval", "12", "--check",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["counters"] and not any(summary["counters"].values())
    assert {fault["kind"] for fault in summary["faults"]} == {
        "kill_instance", "restart_postgres", "leave_burst", "kill_node", "fill_queue", "restart_redis",
        "kill_gateway", "restart_gateway",
    }  # fmt: skip
    assert "faults not followed by an answer" in summary["counters"] and summary["generating answered"] > 0
    assert summary["refused while the shared state was unreachable"] > 0  # the outage was seen, and refused
    assert summary["team budget"]["spent"] <= summary["team budget"]["budget"]
    assert {row["incarnation"].split(" ")[0] for row in summary["growth"]} == {"gw-1", "gw-2"}
