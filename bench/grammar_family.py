"""The pattern guard against llama.cpp itself: the quantifier x atom x nesting family of json_schema patterns,
each timed on a real llama-server (the embedded model), with a prompt whose preferred tokens the patterns
refuse (every candidate token is then checked against every parse the grammar keeps alive).

    python -m bench.grammar_family [--tokens 32] [--limit 15] [--guard FILE]

prints one JSON line per pattern (pattern, the guard's verdict, its cost, seconds to `--tokens` tokens or
null past `--limit`), then the worst time among the patterns the guard accepts. `--guard` reads the
guard from another copy of `engine/schemas.py` (an older tree's), to compare before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

QUANTIFIERS = ("*", "+", "?", "{0,7}", "{0,50}", "{1,40}", "{40}")
ATOMS = ("a", ".", "[a-z]", "(a|aa)", "(a|b)", "(ab|a)")
# The patterns issue 82 found held a model, and some the guard's table measured.
NAMED = (
    "^((.{1,40}){1,40}){1,40}$",
    "^((a{40}){40}){40}$",
    "^((a|aa)*)*$",
    "^((a|aa)+){0,50}$",
    "^a{0,100000}$",
    "^(a{0,30}){0,30}$",
    "^(a{1,30}){1,30}$",
    "^([a-z]{0,50}){0,20}$",
    "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$",
)
PROMPT = "Write a long English sentence about the sea, with spaces:"


def family() -> list[str]:
    """One and two levels of every quantifier around every atom, three levels of a few, and NAMED."""
    found = set(NAMED)
    for atom in ATOMS:
        for inner in QUANTIFIERS:
            found.add(f"^({atom}{inner})$")
            for outer in QUANTIFIERS:
                found.add(f"^(({atom}{inner}){outer})$")
    for atom in ("a", ".", "(a|aa)"):
        for quantifier in ("*", "+", "{0,7}", "{1,40}", "{40}"):
            found.add(f"^((({atom}{quantifier}){quantifier}){quantifier})$")
    return sorted(found)


def _guard(path: Path | None) -> ModuleType:
    if path is None:
        from llmserver.engine import schemas

        return schemas
    spec = importlib.util.spec_from_file_location("guard_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _start(port: int) -> subprocess.Popen[bytes]:
    from llmserver.models.files import embedded_model_path, llama_server_binary

    args = [str(llama_server_binary(None)), "-m", str(embedded_model_path()), "--port", str(port)]
    process = subprocess.Popen(
        [*args, "--parallel", "1", "-c", "1024", "-t", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("llama-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--limit", type=float, default=15.0, help="seconds before a pattern counts as held")
    parser.add_argument("--guard", type=Path, default=None, help="another engine/schemas.py to judge with")
    parser.add_argument("--port", type=int, default=18190)
    parser.add_argument("--accepted-only", action="store_true", help="time only what the guard accepts")
    options = parser.parse_args()
    guard = _guard(options.guard)
    process = _start(options.port)
    worst: float | None = 0.0
    try:
        for pattern in family():
            try:
                cost = guard.check_pattern(pattern, "p", "#")
                verdict = "accepted"
            except Exception:  # the guard's own InvalidRequest (an older tree's class)
                verdict, cost = "refused", None
            took: float | None = None
            if verdict == "accepted" or not options.accepted_only:
                body: dict[str, Any] = {
                    "prompt": PROMPT, "n_predict": options.tokens, "temperature": 0,
                    "json_schema": {"type": "string", "pattern": pattern},
                }  # fmt: skip
                sent = time.monotonic()
                try:
                    httpx.post(f"http://127.0.0.1:{options.port}/completion", json=body, timeout=options.limit)
                    took = round(time.monotonic() - sent, 3)
                except httpx.TimeoutException:  # held: a fresh instance for the next pattern
                    process.kill()
                    process.wait()
                    process = _start(options.port)
                if verdict == "accepted":
                    worst = None if took is None or worst is None else max(worst, took)
            print(json.dumps({"pattern": pattern, "verdict": verdict, "cost": cost, "seconds": took}), flush=True)
    finally:
        process.kill()
    shown = f"over {options.limit:.0f} s" if worst is None else f"{worst:.2f} s"
    print(json.dumps({"worst_accepted": worst, "shown": shown}))


if __name__ == "__main__":
    main()
