"""A node id is one node's: a second `llmserver node` with the id of a live one is refused at start, in
one line, before it starts any instance; once that node is gone (killed: its record lapses within a
lease), the id can be taken again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from tests.support import MODEL, free_port_range, shared_servers, spawn, wait_for

CONFIG = f'[[models]]\nname = "{MODEL}"\nparallel = 1\nctx_size = 512\nthreads = 1\n'


def node_command(data: Path, redis_url: str) -> tuple[list[str], dict[str, str]]:
    data.mkdir(exist_ok=True)
    (data / "config.toml").write_text(CONFIG)
    env = {**os.environ, "LLMSERVER_NODE__ID": "twin", "LLMSERVER_NODE__PORT": "0",
           "LLMSERVER_INSTANCES__API_KEY": "node-identity-test-instance-key",
           "LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4))}  # fmt: skip
    command = [sys.executable, "-m", "llmserver", "node", "--config", str(data / "config.toml"),
               "--data-dir", str(data), "--redis-url", redis_url]  # fmt: skip
    return command, env


def test_a_node_id_held_by_a_live_node_is_refused(tmp_path: Path) -> None:
    _, server = shared_servers()
    client = redis.Redis.from_url(server.url)
    client.delete("llmserver:node:twin")

    def holder() -> str | None:
        held = client.get("llmserver:node:twin")
        return json.loads(held)["incarnation"] if held else None

    first_command, env = node_command(tmp_path / "first", server.url)
    first = spawn(first_command, tmp_path / "first.log", env)
    try:
        assert wait_for(lambda: holder() is not None or first.poll() is not None, 60)
        assert holder() is not None, (tmp_path / "first.log").read_text()
        live = holder()
        second_command, env = node_command(tmp_path / "second", server.url)
        refused = subprocess.run(second_command, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines() == [
            f"Error: node id 'twin' is held by a live node (incarnation {live}): give this node another node.id, "
            "or stop that one"
        ]
        assert "starting" not in refused.stderr + refused.stdout  # no instance was started
        assert holder() == live
        first.send_signal(signal.SIGKILL)  # gone without a word: its record lapses within a lease
        first.wait()
        second = spawn(second_command, tmp_path / "second.log", env)
        try:
            assert wait_for(lambda: holder() not in (None, live), 30), (tmp_path / "second.log").read_text()
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        client.close()
