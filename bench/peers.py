"""The servers a user might pick instead of llmserver, each in a virtual environment of its own under
the data folder (`DATA_DIR/bench-peers/NAME`, created on first use from PyPI), so that their
dependencies never meet ours:

- `litellm`: LiteLLM's proxy in front of the same llama-server (master key, no database);
- `llama-cpp-python`: its own OpenAI server on the same GGUF (compiles llama.cpp at install: about
  15 minutes on 2 cores, once).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import platformdirs

from bench.targets import Target, free_port, wait_ready
from llmserver.models.files import embedded_model_path
from llmserver.settings import ModelConfig

PEERS = Path(platformdirs.user_data_dir("llmserver")) / "bench-peers"
MASTER_KEY = "sk-bench-master-key"


def environment(name: str, requirement: str, module: str) -> Path:
    """The peer's venv (its bin/ folder), created and installed on first use."""
    venv = PEERS / name
    python = venv / "bin" / "python"
    if not python.exists():
        PEERS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, check=False)
    if found.returncode != 0:
        print(f"[bench] installing {requirement} into {venv} (once)", file=sys.stderr, flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], check=True)
    return venv / "bin"


def version(bin_dir: Path, distribution: str) -> str:
    result = subprocess.run(
        [str(bin_dir / "python"), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return result.stdout.strip() or "unknown"


def start_litellm(upstream: Target, model: ModelConfig, log_dir: Path) -> tuple[Target, str]:
    bin_dir = environment("litellm", "litellm[proxy]", "litellm.proxy.proxy_server")
    config = log_dir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {model.name}\n"
        "    litellm_params:\n"
        f"      model: openai/{model.name}\n"
        f"      api_base: {upstream.url}/v1\n"
        "      api_key: none\n"
        "general_settings:\n"
        f"  master_key: {MASTER_KEY}\n"
    )
    port = free_port()
    with (log_dir / "litellm.log").open("ab") as log:
        process = subprocess.Popen(
            [str(bin_dir / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "LITELLM_LOG": "ERROR", "HOME": str(PEERS)},
        )  # fmt: skip
    target = Target("litellm", f"http://127.0.0.1:{port}", process, {"Authorization": f"Bearer {MASTER_KEY}"})
    target.gateway = True
    return wait_ready(target, "/health/liveliness", timeout=300), version(bin_dir, "litellm")


def start_llama_cpp_python(model: ModelConfig, log_dir: Path) -> tuple[Target, str]:
    bin_dir = environment("llama-cpp-python", "llama-cpp-python[server]", "llama_cpp.server")
    port = free_port()
    args = [
        str(bin_dir / "python"), "-m", "llama_cpp.server",
        "--model", str(embedded_model_path()), "--model_alias", model.name,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(model.ctx_size),
        "--n_threads", str(model.threads), "--n_threads_batch", str(model.threads),
        # By default a new request cuts the stream in progress; queued, every client gets its answer.
        "--interrupt_requests", "False",
    ]  # fmt: skip
    with (log_dir / "llama-cpp-python.log").open("ab") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    target = Target("llama-cpp-python", f"http://127.0.0.1:{port}", process)
    return wait_ready(target, "/v1/models", timeout=300), version(bin_dir, "llama_cpp_python")
