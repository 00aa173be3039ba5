"""Fuzz every harness for a bounded time, starting from the committed seed corpus in fuzz/corpus/.

    .venv/bin/python -m fuzz.run --seconds 20             # every harness, 20 s each, one per core at a time
    .venv/bin/python -m fuzz.run --seconds 600 image      # one harness, longer

New inputs the fuzzer finds go to a scratch folder (the committed corpus only grows by hand: copy an
input there when it reaches code the seeds do not). A crash leaves its input in --artifacts and the
run exits 1: make that input a regression test (tests/test_fuzz_corpus.py replays fuzz/corpus/ and
fuzz/crashes/) and fix the code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fuzz.harnesses import HARNESSES

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "corpus"


def fuzz(name: str, seconds: int, artifacts: Path) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as scratch:
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable, "-m", "fuzz.target", name, scratch, str(CORPUS / name),
                f"-max_total_time={seconds}", "-max_len=65536", "-rss_limit_mb=2048", "-timeout=20",
                "-print_final_stats=1", f"-artifact_prefix={artifacts}/{name}-",
            ],
            cwd=ROOT.parent, capture_output=True, text=True, check=False, timeout=seconds + 120,
        )  # fmt: skip
        output = result.stderr + result.stdout
        executions = re.search(r"stat::number_of_executed_units:\s*(\d+)", output)
        coverage = re.findall(r"cov: (\d+)", output)
        return {
            "harness": name,
            "seconds": round(time.monotonic() - started, 1),
            "executions": int(executions.group(1)) if executions else 0,
            "coverage": int(coverage[-1]) if coverage else 0,
            "seeds": len(list((CORPUS / name).iterdir())),
            "crashed": result.returncode != 0,
            "tail": output[-3000:] if result.returncode != 0 else "",
        }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", choices=[*HARNESSES, []], help="harnesses (default: all)")
    parser.add_argument("--seconds", type=int, default=20, help="fuzzing time per harness (default 20)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="harnesses fuzzed at once (default: cores)"
    )
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()), help="where crashes go")
    args = parser.parse_args()
    args.artifacts.mkdir(parents=True, exist_ok=True)
    failed = False
    print("| harness | seconds | executions | coverage | seed inputs | result |")
    print("|---|---|---|---|---|---|")
    # Each harness is one single-threaded process: one per core fuzzes each as long for the same executions.
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = pool.map(lambda name: fuzz(name, args.seconds, args.artifacts), args.names or HARNESSES)
    for row in rows:
        name = row["harness"]
        failed |= bool(row["crashed"])
        print(
            f"| {name} | {row['seconds']} | {row['executions']:,} | {row['coverage']} | {row['seeds']} | "
            f"{'CRASH' if row['crashed'] else 'no crash'} |",
            flush=True,
        )
        if row["crashed"]:
            print(row["tail"], file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
