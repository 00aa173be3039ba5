"""The benchmark harness end to end in its quick mode (its figures are not asserted: the machine is shared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_writes_a_report_with_charts(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "concurrency 16" in result.stderr  # progress is shown as it runs
    report = (tmp_path / "report.md").read_text()
    for section in (
        "## Targets (docs/performance-targets.md)",
        "## Throughput (streamed)",
        "## Gateway overhead",
        "## Other servers",
        "## Conversations after their instance is gone: restored or recomputed",
    ):
        assert section in report
    for clients in (1, 4, 16):
        assert f"\n| {clients} | " in report
    for chart in ("tokens_per_second.png", "ttft.png"):
        assert (tmp_path / chart).read_bytes().startswith(b"\x89PNG")
