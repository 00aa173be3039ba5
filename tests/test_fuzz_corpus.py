"""The fuzz harnesses (fuzz/harnesses.py): every committed seed and every input a fuzzer once crashed
on replays cleanly here; the slow test fuzzes each harness for a bounded time, as CI does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.harnesses import HARNESSES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_seeds_and_past_crashes_replay_cleanly(name: str) -> None:
    inputs = sorted((ROOT / "fuzz" / "corpus" / name).iterdir())
    crashes = ROOT / "fuzz" / "crashes" / name
    inputs += sorted(crashes.iterdir()) if crashes.exists() else []
    assert inputs
    for path in inputs:
        HARNESSES[name](path.read_bytes())


@pytest.mark.slow
def test_bounded_fuzzing_finds_no_crash(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fuzz.run", "--seconds", "10", "--artifacts", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "harness" not in line]
    assert len(rows) == len(HARNESSES)
    for row in rows:
        executions = int(row.split("|")[3].strip().replace(",", ""))
        assert executions > 1000 and row.rstrip().endswith("| no crash |"), row
