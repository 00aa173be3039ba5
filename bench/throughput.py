"""Aggregate generation throughput through llmserver vs. direct llama-server, in one run.

Starts llmserver (one instance, `--parallel 4`) and a plain llama-server with the same model, slots
and threads, then at each concurrency level sends the same non-streamed chat requests to both,
alternating which goes first. The prompt is greedy-decoded to exactly max_tokens, so both targets
generate the same number of tokens.

    .venv/bin/python -m bench.throughput [--levels 1,4,16] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmserver.auth.keys import KeyService
from llmserver.catalog import embedded_model_path, llama_server_binary
from llmserver.pool.instance import llama_server_args
from llmserver.settings import DEFAULT_MODEL_NAME, ModelConfig
from llmserver.store import SQLiteStore
from tests.support import free_port, free_port_range

PROMPT = "Count from 1 to 1000, separated by commas."


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


def run_level(url: str, headers: dict[str, str], clients: int, requests: int, max_tokens: int) -> tuple[float, int]:
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0}

    def one(_: int) -> int:
        with httpx.Client(timeout=600) as client:
            reply = client.post(url + "/v1/chat/completions", json=body, headers=headers)
            reply.raise_for_status()
            return int(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    args = parser.parse_args()
    model = ModelConfig(name=DEFAULT_MODEL_NAME, parallel=4, ctx_size=1024, threads=2)
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-"))
    config = data_dir / "config.toml"
    config.write_text(f'[[models]]\nname = "{model.name}"\nparallel = 4\nctx_size = 1024\nthreads = 2\n')
    gateway_port, instance_port, direct_port = free_port(), free_port_range(2), free_port()
    store = SQLiteStore(data_dir / "llmserver.db")
    key = KeyService(store).create("bench")[1]
    store.close()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "llmserver", "serve", "--config", str(config), "--data-dir", str(data_dir),
         "--port", str(gateway_port), "--log-level", "warning"],
        env={"LLMSERVER_INSTANCE_BASE_PORT": str(instance_port), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    direct_args = llama_server_args(llama_server_binary(None), embedded_model_path(), model, "127.0.0.1", direct_port)
    direct = subprocess.Popen(direct_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    targets = {
        "llmserver": (f"http://127.0.0.1:{gateway_port}", {"Authorization": f"Bearer {key}"}),
        "direct": (f"http://127.0.0.1:{direct_port}", {}),
    }
    try:
        wait_ready(targets["llmserver"][0] + "/ready")
        wait_ready(targets["direct"][0] + "/health")
        for url, headers in targets.values():
            run_level(url, headers, 1, 1, 8)  # warm up
        print(f"model {model.name}, parallel 4, threads 2, max_tokens {args.max_tokens}, greedy")
        print(f"{'clients':>7} {'llmserver tok/s':>16} {'direct tok/s':>13} {'ratio':>6}")
        for level, clients in enumerate(int(c) for c in args.levels.split(",")):
            order = list(targets) if level % 2 == 0 else list(reversed(targets))
            speed = {}
            for name in order:
                url, headers = targets[name]
                seconds, tokens = run_level(url, headers, clients, clients * args.rounds, args.max_tokens)
                speed[name] = tokens / seconds
            ratio = speed["llmserver"] / speed["direct"]
            print(f"{clients:>7} {speed['llmserver']:>16.1f} {speed['direct']:>13.1f} {ratio:>6.3f}", flush=True)
    finally:
        gateway.terminate()
        direct.terminate()
        gateway.wait(30)
        direct.wait(30)


if __name__ == "__main__":
    main()
