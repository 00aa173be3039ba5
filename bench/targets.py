"""The servers under test, each started fresh by the benchmark on this machine.

- `llmserver`: the gateway with one instance of the model.
- `llama-server`: a plain llama-server started with exactly the arguments llmserver gives its
  instance (same model, slots, context, threads), so the difference is the gateway alone.
- `passthrough`: a bare pass-through proxy (bench/passthrough.py) in front of that llama-server: the
  floor of what a gateway on this stack costs.
- the peers a user might pick instead (LiteLLM's proxy, llama-cpp-python's server): bench/peers.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from llmserver.auth.keys import KeyService
from llmserver.models.files import embedded_model_path, llama_server_binary
from llmserver.pool.instance import llama_server_args
from llmserver.settings import DEFAULT_MODEL_NAME, ModelConfig
from llmserver.store import NO_LIMITS, KeyLimits, open_store
from tests.support import free_port, free_port_range

if TYPE_CHECKING:
    from tests.support.services import Postgres


async def _create_key(database_url: str, limits: KeyLimits = NO_LIMITS) -> str:
    store = await open_store(database_url)
    try:
        return (await KeyService(store).create("bench", limits=limits))[1]
    finally:
        await store.close()


@dataclass
class Target:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    model: str = DEFAULT_MODEL_NAME
    # A gateway in front of an engine: its process's CPU time is what the gateway costs (engines: False).
    gateway: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_ready(target: Target, path: str, timeout: float = 180) -> Target:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.process.poll() is not None:
            raise RuntimeError(f"{target.name} exited with {target.process.returncode} while starting")
        try:
            if httpx.get(target.url + path, headers=target.headers, timeout=2).status_code == 200:
                return target
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    target.stop()
    raise RuntimeError(f"{target.name} was not ready within {timeout:.0f} s")


def model_config(parallel: int, ctx_size: int, threads: int) -> ModelConfig:
    return ModelConfig(name=DEFAULT_MODEL_NAME, parallel=parallel, ctx_size=ctx_size, threads=threads)


def model_toml(model: ModelConfig) -> str:
    """The model's table in an llmserver config file."""
    return (
        f'[[models]]\nname = "{model.name}"\nparallel = {model.parallel}\nctx_size = {model.ctx_size}\n'
        f"threads = {model.threads}\nmin_instances = {model.min_instances}\nmax_instances = {model.max_instances}\n"
    )


def migrated_database(postgres: Postgres) -> str:
    """A new database on the private PostgreSQL server, with llmserver's schema applied."""
    url = postgres.new_database()
    migrated = subprocess.run(
        [sys.executable, "-m", "llmserver", "db", "migrate", "--database-url", url],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if migrated.returncode != 0:
        raise SystemExit(migrated.stderr)
    return url


def start_llmserver(
    model: ModelConfig,
    log_dir: Path,
    *,
    name: str = "llmserver",
    settings: str = "",
    env: dict[str, str] | None = None,
    limits: KeyLimits = NO_LIMITS,
) -> Target:
    """llmserver on the model; `settings` are extra top-level settings lines of its config file, `env`
    may name its database (LLMSERVER_STATE__DATABASE_URL, migrated), where its key is made with `limits`."""
    data_dir = Path(tempfile.mkdtemp(prefix="llmserver-bench-"))
    config = data_dir / "config.toml"
    config.write_text(settings + model_toml(model))
    database_url = (env or {}).get("LLMSERVER_STATE__DATABASE_URL") or f"sqlite:///{data_dir / 'llmserver.db'}"
    key = asyncio.run(_create_key(database_url, limits))
    port = free_port()
    instances = free_port_range(4, avoid=port)  # its instances take instances, +1, …: none the gateway's
    env = {**os.environ, "LLMSERVER_INSTANCES__BASE_PORT": str(instances), **(env or {})}
    with (log_dir / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llmserver", "serve", "--config", str(config), "--data-dir", str(data_dir),
             "--port", str(port), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    target = Target(name, f"http://127.0.0.1:{port}", process, {"Authorization": f"Bearer {key}"}, gateway=True)
    return wait_ready(target, "/ready")


def start_passthrough(upstream: Target, log_dir: Path, client: str = "aiohttp") -> Target:
    """The bare pass-through proxy (bench/passthrough.py) in front of `upstream`: the floor, with
    aiohttp or (`client="wire"`) llmserver's own client towards llama-server."""
    port = free_port()
    name = "passthrough" if client == "aiohttp" else f"passthrough-{client}"
    with (log_dir / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.passthrough", "--upstream", upstream.url, "--port", str(port),
             "--client", client],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    target = Target(name, f"http://127.0.0.1:{port}", process, gateway=True)
    return wait_ready(target, "/health")  # relayed to llama-server


def start_llama_server(model: ModelConfig, log_dir: Path) -> Target:
    port = free_port()
    args = llama_server_args(llama_server_binary(None), embedded_model_path(), model, "127.0.0.1", port)
    with (log_dir / "llama-server.log").open("ab") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return wait_ready(Target("llama-server", f"http://127.0.0.1:{port}", process), "/health")
