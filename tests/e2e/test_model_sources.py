"""Models fetched from a Hugging Face endpoint (a stand-in on 127.0.0.1), pulled ahead or on first use."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from llmserver.models.files import embedded_model_path
from tests.support import Server, cli, make_key, wait_for
from tests.support.hub import StandInHub

# Each test here starts servers of its own or waits on timers: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

REPO, FILE = "test-org/tiny-GGUF", "tiny-q4_1.gguf"


def hub_config(name: str = "tiny") -> str:
    return f'[[models]]\nname = "{name}"\nhf_repo = "{REPO}"\nhf_file = "{FILE}"\nparallel = 1\nctx_size = 512\n'


@pytest.fixture
def gguf() -> bytes:
    # The GGUF this test serves: a copy of the embedded model's bytes.
    return embedded_model_path().read_bytes()


@pytest.fixture
def hub(gguf: bytes) -> Iterator[StandInHub]:
    running = StandInHub(files={f"{REPO}/{FILE}": gguf}).start()
    yield running
    running.stop()


def test_pull_resumes_an_interrupted_download(tmp_path: Path, hub: StandInHub, gguf: bytes) -> None:
    config = tmp_path / "c.toml"
    config.write_text(hub_config())
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
    listed = cli(tmp_path, "models", "--config", str(config), env=env)
    assert listed.returncode == 1 and "not downloaded yet" in listed.stdout  # listing never downloads
    hub.cut_first_download_at = len(gguf) // 3
    first = cli(tmp_path, "models", "pull", "tiny", "--config", str(config), env=env)
    if first.returncode != 0:  # the cut surfaced as an error: a second pull resumes from the partial file
        assert "could not download" in first.stderr
        second = cli(tmp_path, "models", "pull", "tiny", "--config", str(config), env=env)
        assert second.returncode == 0, second.stderr
    # The second GET asked only for the rest: from what the first had written to disk (whole chunks).
    ranges = [r for method, _, r in hub.requests if method == "GET" and r]
    assert ranges, hub.requests
    assert 0 < int(ranges[-1].removeprefix("bytes=").rstrip("-")) <= len(gguf) // 3
    (downloaded,) = (tmp_path / "models").rglob(FILE)
    assert hashlib.sha256(downloaded.read_bytes()).digest() == hashlib.sha256(gguf).digest()
    listed = cli(tmp_path, "models", "--config", str(config), env=env)
    assert listed.returncode == 0 and FILE in listed.stdout


def test_missing_file_and_offline_are_clear_errors(tmp_path: Path, hub: StandInHub) -> None:
    config = tmp_path / "c.toml"
    config.write_text(hub_config().replace(FILE, "no-such.gguf"))
    missing = cli(tmp_path, "models", "pull", "tiny", "--config", str(config), env={"HF_ENDPOINT": hub.url})
    assert missing.returncode == 1
    assert "could not download test-org/tiny-GGUF/no-such.gguf@main" in missing.stderr
    offline = cli(tmp_path, "models", "pull", "tiny", "--config", str(config), env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "HF_HUB_OFFLINE is set" in offline.stderr and "online" not in offline.stderr


def test_served_model_is_fetched_on_first_use(
    tmp_path: Path, hub: StandInHub, start_server: Callable[..., Server]
) -> None:
    server = start_server(hub_config(), env={"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"})
    key = make_key(tmp_path, "k")
    response = httpx.post(
        server.url + "/api/generate",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["model"] == "tiny"
    assert any(method == "GET" for method, _, _ in hub.requests)


def test_builtin_catalog_names_the_seeds_model(tmp_path: Path, hub: StandInHub, gguf: bytes) -> None:
    hub.files["Qwen/Qwen2.5-1.5B-Instruct-GGUF/qwen2.5-1.5b-instruct-q2_k.gguf"] = gguf  # stands in for the real one
    pulled = cli(
        tmp_path,
        "models",
        "pull",
        "Qwen2.5-1.5B-Instruct-Q2_K",
        env={"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"},
    )
    assert pulled.returncode == 0, pulled.stderr
    assert "Qwen2.5-1.5B-Instruct-Q2_K: " in pulled.stdout and "qwen2.5-1.5b-instruct-q2_k.gguf" in pulled.stdout


def test_a_download_s_progress_is_in_the_model_s_record(
    tmp_path: Path, hub: StandInHub, gguf: bytes, start_server: Callable[..., Server]
) -> None:
    """A model added to the catalog with hf_repo is fetched by the host that will run it; while its file
    downloads, GET /api/models says how far it is (and the instance starts once it is whole)."""
    hub.seconds_per_download = 4.0
    server = start_server(env={"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"})
    admin = make_key(tmp_path, "admin", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    tiny = {"name": "tiny", "hf_repo": REPO, "hf_file": FILE, "parallel": 1, "ctx_size": 512}
    added = httpx.post(server.url + "/api/models", json=tiny, headers=headers, timeout=60)
    assert added.status_code == 201, added.text
    seen: list[dict[str, object]] = []

    def fetching() -> bool:
        progress = httpx.get(server.url + "/api/models/tiny", headers=headers).json()["fetching"]
        seen.extend(progress)
        return any(0 < int(str(p["bytes"])) < len(gguf) for p in progress)

    assert wait_for(fetching, 30), (seen, server.log()[-2000:])
    assert seen[-1]["node"] is None and seen[-1]["total"] == len(gguf)  # this host, the file's whole size

    def ready() -> bool:
        record = httpx.get(server.url + "/api/models/tiny", headers=headers).json()
        return record["fetching"] == [] and record["ready_instances"] == 1

    assert wait_for(ready, 60), server.log()[-2000:]
