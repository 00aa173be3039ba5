"""Schemathesis against our own /openapi.json: generated and mutated requests for every endpoint
(the instance admin endpoints aside: they start and stop processes), bounded, with a fixed seed.
No answer may be a 5xx, and every 4xx must be the error envelope (tests/support/fuzz_hooks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.support import Server, make_key

ROOT = Path(__file__).resolve().parents[2]
# Generation is cut short: the fuzzer exercises validation and routing, not the model.
CONFIG = """
limits.max_tokens = 8
limits.default_max_tokens = 4
[[models]]
name = "SmolLM2-135M-Instruct-Q4_1"
ctx_size = 512
threads = 1
"""


def test_no_endpoint_answers_5xx_or_breaks_the_envelope(start_server: Callable[..., Server], tmp_path: Path) -> None:
    server = start_server(CONFIG)
    admin = make_key(server.data_dir, "fuzz", admin=True)
    ran = subprocess.run(
        [
            str(Path(sys.executable).parent / "st"), "run", server.url + "/openapi.json",
            "-H", f"Authorization: Bearer {admin}",
            "--checks", "not_a_server_error,error_envelope",
            "--max-examples", "25", "--seed", "1",
            "--exclude-path-regex", "instances",
        ],
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.fuzz_hooks", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600, cwd=tmp_path,  # its crash cache stays out of the tree
    )  # fmt: skip
    summary = ran.stdout[-3000:]
    # On a failure the server's own account of the request is the half of the story the fuzzer lacks.
    assert ran.returncode == 0, summary + "\n--- server log ---\n" + server.log()[-6000:]
    assert " passed" in summary and "failed" not in summary.split("Test cases:")[-1], summary
    assert "Traceback" not in server.log()
