"""The request log's page time (GET /api/usage/requests, store.usage_page) on a large ledger.

    python -m bench.request_log [--rows 1000000] [--repeat 5] [--database-url sqlite:///PATH]

Fills a new ledger (a SQLite file in a temporary folder unless --database-url names an empty migrated
database) with `--rows` requests of 50 keys and 5 models, one a second, 1 % of them errors, then times
one page of 51 rows (the API's default 50, and one more to tell whether there is a next page) for each
query the console makes: the newest, filtered by model, by status, by key, a filter matching nothing (a
scan of the range: the worst case), the next page, a page half-way down, and a narrow range of old rows.
Medians of `--repeat` runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from llmserver.store import LedgerQuery, Store, UsageBatch, open_store

START = 1.0e9


async def fill(store: Store, rows: int) -> None:
    batch: list[dict[str, object]] = []
    for i in range(rows):
        batch.append(
            {
                "time": START + i, "key_id": f"key{i % 50}", "model": f"m{i % 5}", "instance_id": "bench",
                "endpoint": "/api/generate", "prompt_tokens": 10, "completion_tokens": 5, "latency_ms": 3.0,
                "ttft_ms": 1.0, "tokens_per_second": 5.0, "outcome": "server_error" if i % 100 == 0 else "ok",
            }
        )  # fmt: skip
        if len(batch) == 50_000:
            await store.record(UsageBatch(rows=batch))
            batch = []
    if batch:
        await store.record(UsageBatch(rows=batch))


async def measure(url: str, rows: int, repeat: int) -> list[tuple[str, int, float]]:
    store = await open_store(url)
    try:
        await fill(store, rows)
        newest = await store.usage_page(LedgerQuery(limit=51))
        middle = await store.usage_page(LedgerQuery(limit=51, until=START + rows / 2))
        queries = {
            "newest": LedgerQuery(limit=51),
            "one model": LedgerQuery(model="m3", limit=51),
            "errors": LedgerQuery(status="error", limit=51),
            "one key": LedgerQuery(key_id="key7", limit=51),
            "a model with no rows (scan)": LedgerQuery(model="none", limit=51),
            "the next page": LedgerQuery(limit=51, before=int(str(newest[-1]["id"]))),
            "a page half-way down": LedgerQuery(limit=51, before=int(str(middle[-1]["id"]))),
            "a narrow old range": LedgerQuery(limit=51, until=START + 1000),
        }
        results = []
        for name, query in queries.items():
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                page = await store.usage_page(query)
                times.append((time.perf_counter() - started) * 1000)
            results.append((name, len(page), statistics.median(times)))
        return results
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", default=None)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        url = options.database_url or f"sqlite:///{Path(folder) / 'ledger.db'}"
        results = asyncio.run(measure(url, options.rows, options.repeat))
    print(f"request log, {options.rows:,} ledger rows, medians of {options.repeat}:")
    for name, count, median in results:
        print(f"  {name}: {count} rows in {median:.1f} ms")


if __name__ == "__main__":
    main()
