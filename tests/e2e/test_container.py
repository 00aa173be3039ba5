"""The container image, built for real and run: deploy/container/Containerfile built by `buildah bud` on a
Debian bookworm base made here with `debootstrap` (no base image can be pulled on this machine), offline
from the wheels scripts/container_wheels.py gathers, exactly as docs/operating/containers.md tells an
operator; then the image's filesystem run with `buildah run --isolation chroot` (no container runtime
starts containers here): `llmserver serve` inside, as the image's non-root user, answers /api/generate
with a key made by `llmserver keys create` inside it, and the image's own health check passes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support import free_port, free_port_range, wait_for, wait_ready

pytestmark = pytest.mark.slow  # a Debian base, an image build and a first start: about three minutes

ROOT = Path(__file__).resolve().parents[2]
MIRROR = os.environ.get("LLMSERVER_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = "localhost/debian-bookworm-minbase"
IMAGE = "localhost/llmserver:test"


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{args[:6]}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def buildah(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """buildah on a private store (vfs: no overlay mounts needed), holding the bookworm base image."""
    work = tmp_path_factory.mktemp("container")
    command = ["buildah", "--root", str(work / "storage"), "--runroot", str(work / "run"), "--storage-driver", "vfs"]
    rootfs = work / "rootfs"
    run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], 900)
    scratch = run([*command, "from", "scratch"], 60).stdout.strip()
    mount = run([*command, "mount", scratch], 60).stdout.strip()
    run(["cp", "-a", f"{rootfs}/.", mount], 300)
    run([*command, "umount", scratch], 60)
    run([*command, "commit", "--quiet", scratch, BASE], 300)
    run([*command, "rm", scratch], 60)
    shutil.rmtree(rootfs)
    try:
        yield command
    finally:
        subprocess.run([*command, "rm", "--all"], capture_output=True, timeout=120, check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_the_image_builds_offline_and_serves_as_a_non_root_user(buildah: list[str], tmp_path: Path) -> None:
    run([sys.executable, str(ROOT / "scripts" / "container_wheels.py")], 1800)
    run([*buildah, "bud", "--isolation", "chroot", "--format", "docker", "--layers=false",
         "--build-arg", f"BASE={BASE}", "--build-arg", "OFFLINE=1",
         "-f", str(ROOT / "deploy" / "container" / "Containerfile"), "-t", IMAGE, str(ROOT)], 1800)  # fmt: skip
    inspected = json.loads(run([*buildah, "inspect", "--type", "image", IMAGE], 60).stdout)["Docker"]["config"]
    assert inspected["User"] == "llmserver" and "/data" in inspected["Volumes"]
    assert inspected["Entrypoint"] == ["llmserver"] and inspected["Cmd"][0] == "serve"
    health = inspected["Healthcheck"]["Test"]
    assert health[0] == "CMD"  # kept: the docker format carries HEALTHCHECK (OCI drops it)

    container = run([*buildah, "from", "--quiet", IMAGE], 120).stdout.strip()
    port, admin = free_port(), "sk-admin-container-test-0123456789"
    settings = {"LLMSERVER_ADMIN_KEY": admin, "LLMSERVER_SERVER__PORT": str(port)}
    # The chroot shares this host's network: instances get free ports here, not the default 8001.
    settings["LLMSERVER_INSTANCES__BASE_PORT"] = str(free_port_range(4, avoid=port))
    inside = [*buildah, "run", "--isolation", "chroot"]
    for name, value in settings.items():
        inside += ["-e", f"{name}={value}"]
    inside.append(container)
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen([*inside, "--", "llmserver", "serve", "--host", "127.0.0.1"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        assert wait_ready(port, server, 300), (tmp_path / "serve.log").read_text()[-3000:]
        assert run([*inside, "--", *health[1:]], 60).returncode == 0
        assert run([*inside, "--", "id", "-un"], 60).stdout.strip() == "llmserver"
        created = run([*inside, "--", "llmserver", "keys", "create", "--name", "image"], 120)
        key = created.stdout.strip().splitlines()[-1]
        answer = httpx.post(f"http://127.0.0.1:{port}/api/generate", headers={"Authorization": f"Bearer {key}"},
                            json={"prompt": "Say hi.", "max_tokens": 4}, timeout=120)  # fmt: skip
        assert answer.status_code == 200 and answer.json()["model"] == "SmolLM2-135M-Instruct-Q4_1", answer.text
        assert answer.json()["completion_tokens"] > 0
        # The gateway and its llama-server, seen from this host, run as the image's user (uid 10001).
        served = image_processes()
        assert any("llama-server" in " ".join(cmd) for cmd, _ in served) and len(served) >= 2, served
        assert {uid for _, uid in served} == {10001}, served
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
        log.close()
        assert wait_for(lambda: not image_processes(), 60), image_processes()


def image_processes() -> list[tuple[list[str], int]]:
    """The processes running the image's programs (its venv is /opt/llmserver): command line and uid."""
    found = []
    for process in psutil.process_iter(["cmdline", "uids"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("/opt/llmserver/"):
            found.append((cmdline, process.info["uids"].real))
    return found
