"""Every example in the README and the documentation site (docs/) runs against a real server, so that
none can rot.

Shell blocks run in bash with the placeholders filled in (the server's address, `$KEY`,
`$ADMIN_KEY`, `KEY_ID`, `$ID`, an instance id, `photo.png` and `report.pdf` in the working folder);
each answer must be a success, and where a page shows an answer (a json block right after),
the real one must have the fields it shows. Python blocks run with `KEY` set. TOML blocks must be
valid settings. Only commands that install, serve, test or benchmark are left to CI itself, and
the internet-only vision model of the docs is served by the test vision tower under its name.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmserver.settings import Settings
from tests.support import MODEL, Server, documents, make_key, make_key_record, shared_servers, state_env
from tests.support.images import png
from tests.support.jobs import poll_until_done
from tests.support.vision_model import write_vision_model

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent
DOCUMENTED_INSTANCE = "3f9c0a1b2c4d"
DOCUMENTED_DATABASE = "postgresql://llmserver:secret@db.internal/llmserver"
DOCUMENTED_REDIS = "redis://cache.internal:6379/0"
# Commands the README shows that CI runs in its own way (install, serve, nodes, test, benchmark, promtool:
# tests/test_deploy_prometheus.py), the GPU build, which this machine (no GPU, no CUDA) cannot run, a
# service's installation as root (tests/test_systemd.py checks its units and their notify protocol), and
# container and Kubernetes commands (no runtime here: tests/test_deploy.py validates their files), and the
# coding agents (tests/agents/ runs them, with the settings their pages give).
NOT_HERE = re.compile(
    r"scripts/setup\.sh|llmserver serve|llmserver node|-m pytest|-m bench|-m fuzz|ruff check|mypy|promtool"
    r"|CMAKE_ARGS="
    r"|useradd|systemctl|/etc/llmserver|/etc/systemd|runuser|/opt/llmserver/\.venv"
    r"|buildah |docker |kubectl |cd deploy/compose|container_wheels|^(claude|codex|aider) "
)


@dataclass
class Block:
    page: str
    lang: str
    code: str
    line: int
    shown: str | None  # the json block that follows it, if any

    @property
    def id(self) -> str:
        return f"{self.page}:{self.lang}@{self.line}"


def blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def page_blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    name = str(page.relative_to(ROOT))
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = re.match(r"^```(\w+)$", lines[index])
        if not match:
            index += 1
            continue
        end = lines.index("```", index + 1)
        block = Block(name, match[1], "\n".join(lines[index + 1 : end]), index + 1, None)
        if found and found[-1].lang in ("sh", "bash") and block.lang == "json" and found[-1].line >= index - 12:
            found[-1].shown = block.code
        found.append(block)
        index = end + 1
    return found


def runnable(block: Block) -> list[str]:
    return [line for line in block.code.splitlines() if line.strip() and not NOT_HERE.search(line)]


# Blocks made only of install, serve, test and benchmark commands are not run here: CI runs them.
SHELL = [b for b in blocks() if b.lang in ("sh", "bash") and runnable(b)]
PYTHON = [b for b in blocks() if b.lang == "python"]
TOML = [b for b in blocks() if b.lang == "toml" and not b.page.startswith("docs/agents/")]  # (Codex's own file)


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("readme")
    model, mmproj = write_vision_model(folder / "vision")
    config = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 2048
max_instances = 3
threads = 1

[[models]]
name = "SmolVLM-256M"
path = "{model}"
mmproj = "{mmproj}"
parallel = 1
ctx_size = 1024
threads = 1

[[models]]
name = "embed"
embedding = true
pooling = "mean"
parallel = 1
ctx_size = 512
threads = 1
"""
    server = Server(data_dir=folder / "data", config=config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def filled(readme_server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The values the README's placeholders stand for, and a working folder with its files."""
    server = readme_server
    work = tmp_path_factory.mktemp("work")
    (work / "photo.png").write_bytes(png(32, 32))
    (work / "report.pdf").write_bytes(documents.make_pdf("Quarterly report: revenue rose by 12 percent."))
    admin = make_key(server.data_dir, "readme-admin", admin=True)
    key = make_key(server.data_dir, "readme")
    key_id, _ = make_key_record(server.data_dir, "readme-target")
    job, _ = submit_job(server, key)
    extra = httpx.post(
        server.url + "/api/instances", json={"model": MODEL}, headers={"Authorization": f"Bearer {admin}"}, timeout=120
    ).json()
    postgres, redis = shared_servers()  # for the Many gateways example: a fresh database, the tests' Redis
    return {
        "work": work, "admin": admin, "key": key, "key_id": key_id, "job": job, "instance": extra["instance_id"],
        "database_url": postgres.new_database(), "redis_url": redis.url,
    }  # fmt: skip


def submit_job(server: Server, api_key: str) -> tuple[dict[str, Any], str]:
    """A small async job: the submit answer and the (base64) key its result is encrypted under."""
    key = base64.b64encode(os.urandom(32)).decode()
    body = {"prompt": "Say hi.", "max_tokens": 4, "mode": "async", "key": key}
    answer = httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {api_key}"})
    return answer.json(), key


def fill(code: str, server: Server, values: dict[str, Any]) -> str:
    return (
        code.replace("http://127.0.0.1:8000", server.url)
        .replace(".venv/bin/", f"{BIN}/")
        .replace("KEY_ID", values["key_id"])
        .replace(DOCUMENTED_INSTANCE, values["instance"])
        .replace(DOCUMENTED_DATABASE, values["database_url"])
        .replace(DOCUMENTED_REDIS, values["redis_url"])
    )


def shell_env(server: Server, values: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        **state_env(server.data_dir),
        "KEY": values["key"],
        "ADMIN_KEY": values["admin"],
        "ID": values["job"]["tracking_id"],
        "LLMSERVER_DATA_DIR": str(server.data_dir),
        "LLMSERVER_SERVER__PORT": str(server.port),
        "PYTHONPATH": str(ROOT),  # `python -m tests.…` as from the repository
    }


def answers(output: str) -> list[Any]:
    """The JSON documents (or SSE events) in what the commands printed."""
    found: list[Any] = []
    decoder = json.JSONDecoder()
    text = output.strip()
    while text:
        if text.startswith("data: "):
            line, _, text = text.partition("\n")
            payload = line.removeprefix("data: ").strip()
            found.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        elif text[0] in "{[" and (decoded := _decoded(decoder, text)) is not None:
            found.append(decoded[0])
            text = text[decoded[1] :]
        else:
            _, _, text = text.partition("\n")  # a line that is not JSON (a key, a message)
        text = text.strip()
    return found


def _decoded(decoder: json.JSONDecoder, text: str) -> tuple[Any, int] | None:
    """A JSON document at the start of `text`; None for a line of prose that merely starts with a brace
    (a model's free-text answer, as `llmserver ask` prints it, may hold code)."""
    try:
        return decoder.raw_decode(text)
    except json.JSONDecodeError:
        return None


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_example(block: Block, readme_server: Server, filled: dict[str, Any]) -> None:
    script = fill("\n".join(runnable(block)), readme_server, filled)
    ran = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=filled["work"],
        env=shell_env(readme_server, filled),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, f"{block.page} line {block.line}:\n{script}\n{ran.stdout}\n{ran.stderr}"
    documents_out = answers(ran.stdout)
    for answer in documents_out:
        # A response object's `error` is null when it succeeded; Anthropic's errors say `"type": "error"`.
        failed = isinstance(answer, dict) and (answer.get("error") is not None or answer.get("type") == "error")
        assert not failed, f"{block.page} line {block.line}: {answer}"
    if block.shown is not None:
        shown = json.loads(re.sub(r'"\.\.\.', '"', block.shown).replace("...", "0"))
        assert documents_out, f"{block.page} line {block.line} printed nothing"
        first = documents_out[0]
        missing = set(shown) - set(first) if isinstance(shown, dict) else set()
        assert not missing, f"{block.page} line {block.line}: the answer lacks {missing}"
    if "-sN" in block.code:
        assert documents_out[-1] == "[DONE]"


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_example(block: Block, readme_server: Server, filled: dict[str, Any]) -> None:
    code = block.code.replace("http://127.0.0.1:8000", readme_server.url)
    scope: dict[str, Any] = {"KEY": filled["key"], "__name__": "readme_example"}
    exec(compile(code, f"{block.page}:{block.line}", "exec"), scope)
    if "decrypt" in scope:  # the decryption recipe: it must open a real result
        submitted, key = submit_job(readme_server, filled["key"])
        done = poll_until_done(readme_server, filled["key"], submitted["tracking_id"])
        plain = scope["decrypt"](done["result"], submitted["nonce"], key)
        assert plain["response"] and plain["completion_tokens"] == 4


@pytest.mark.parametrize("block", TOML, ids=[b.id for b in TOML])
def test_toml_example_is_valid_settings(block: Block) -> None:
    Settings.model_validate(tomllib.loads(block.code))
