"""The names settings had before they were put in sections still work from the command line: each is
read as its new name and said once, on stderr (`llmserver config`, every command but serve and node)
or as a warning in the log (`serve`, `node`, where the log is configured first)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def llmserver(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVER_")}
    return subprocess.run(
        [sys.executable, "-m", "llmserver", *args],
        capture_output=True, text=True, timeout=60, env={**clean, **env}, check=False,
    )  # fmt: skip


def test_config_reads_old_names_and_warns_once_each(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("max_tokens_limit = 100\ndefault_max_tokens = 50\n[server]\nhost = '127.0.0.9'\n")
    ran = llmserver("config", "--config", str(config), "--data-dir", str(tmp_path), env={"LLMSERVER_PORT": "9001"})
    assert ran.returncode == 0, ran.stderr
    effective = json.loads(ran.stdout)
    assert effective["server"] == {**effective["server"], "host": "127.0.0.9", "port": 9001}
    assert (effective["limits"]["max_tokens"], effective["limits"]["default_max_tokens"]) == (100, 50)
    assert sorted(ran.stderr.strip().splitlines()) == sorted(
        [
            "warning: LLMSERVER_PORT is deprecated: set LLMSERVER_SERVER__PORT instead",
            f"warning: {config}: the setting default_max_tokens is deprecated: "
            "set default_max_tokens in [limits] instead",
            f"warning: {config}: the setting max_tokens_limit is deprecated: set max_tokens in [limits] instead",
        ]
    )


def test_new_names_say_nothing(tmp_path: Path) -> None:
    ran = llmserver("config", "--data-dir", str(tmp_path), env={"LLMSERVER_SERVER__PORT": "9001"})
    assert ran.returncode == 0 and ran.stderr == "" and json.loads(ran.stdout)["server"]["port"] == 9001


def test_serve_logs_the_old_name_it_was_started_with(tmp_path: Path) -> None:
    with socket.socket() as taken:  # the port the old name gives is taken: serve stops right after its checks
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"LLMSERVER_PORT": str(port), "LLMSERVER_OBSERVABILITY__LOG_FORMAT": "json"}
        ran = llmserver("serve", "--data-dir", str(tmp_path), env=env)
    assert ran.returncode == 1, ran.stderr
    records = [json.loads(line) for line in ran.stderr.splitlines() if line.startswith("{")]
    warned = [r for r in records if r["logger"] == "llmserver.settings"]
    assert [(r["level"], r["message"]) for r in warned] == [
        ("WARNING", "LLMSERVER_PORT is deprecated: set LLMSERVER_SERVER__PORT instead")
    ]
    assert f"127.0.0.1:{port}" in ran.stderr.splitlines()[-1]  # the old name's port is the one it tried
