"""The request-log benchmark runs, on a small ledger: every query answers the rows it should."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench import request_log


def test_the_request_log_benchmark_pages_a_small_ledger(tmp_path: Path) -> None:
    results = asyncio.run(request_log.measure(f"sqlite:///{tmp_path / 'ledger.db'}", 3_000, 1))
    rows = {name: count for name, count, _ in results}
    assert rows == {
        "newest": 51, "one model": 51, "errors": 30, "one key": 51, "a model with no rows (scan)": 0,
        "the next page": 51, "a page half-way down": 51, "a narrow old range": 51,
    }  # fmt: skip
