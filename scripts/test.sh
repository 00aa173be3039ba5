#!/usr/bin/env bash
# The test suite in two passes: first every test that shares the machine well, two test files at a
# time (pytest-xdist: one process per CPU, at most 2 — each file's tests run in order in one process,
# with its module's servers), then the tests marked `alone` one after another: those that measure
# (the benchmark's quick mode, the soaks) or fill the machine themselves (the coding agents).
# Arguments are passed to both passes (`bash scripts/test.sh tests/e2e -x`). A plain
# `.venv/bin/python -m pytest` runs the same tests in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=$(( $(nproc) < 2 ? 1 : 2 ))
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile -m "not alone" "$@" || status=$?
# 5: no test selected (arguments that name only the other pass's tests).
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
alone=0
.venv/bin/python -m pytest -m alone "$@" || alone=$?
if [ "$alone" -ne 0 ] && [ "$alone" -ne 5 ]; then exit "$alone"; fi
