"""A catalog model's file served by a gateway to the nodes that lack it (`node.gateway_url`): a real
gateway (`llmserver serve`) serves its copy with the instance key; `fetch_from_gateway`, as a node calls
it, downloads it, resumes a cut download from what was written, and refuses a copy whose SHA-256 differs."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from llmserver.models.files import CHECKSUM_HEADER, ModelFileError, embedded_model_path, fetch_from_gateway
from llmserver.settings import ModelConfig
from tests.support import Server, make_key, wait_for

pytestmark = pytest.mark.slow

NODE_KEY = "model-files-node-key-0123456789abcdef"


@pytest.fixture
def served(tmp_path: Path, start_server: Callable[..., Server]) -> tuple[Server, Path, str]:
    server = start_server(env={"LLMSERVER_INSTANCES__API_KEY": NODE_KEY})
    admin = make_key(tmp_path, "admin", admin=True)
    original = tmp_path / "models" / "shared.gguf"
    original.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(embedded_model_path(), original)
    body = {"name": "shared", "path": str(original), "min_instances": 0}
    added = httpx.post(server.url + "/api/models", json=body, headers={"Authorization": f"Bearer {admin}"})
    assert added.status_code == 201, added.text
    return server, original, admin


def test_the_gateway_serves_a_model_s_file_to_the_node_key_with_its_checksum(
    served: tuple[Server, Path, str], tmp_path: Path
) -> None:
    server, original, admin = served
    url = server.url + "/api/models/shared/file"
    assert httpx.head(url).status_code == 401
    user = make_key(tmp_path, "user")
    assert httpx.head(url, headers={"Authorization": f"Bearer {user}"}).status_code == 403
    head = httpx.head(url, headers={"Authorization": f"Bearer {NODE_KEY}"})
    assert head.status_code == 200 and int(head.headers["content-length"]) == original.stat().st_size
    assert head.headers[CHECKSUM_HEADER] == hashlib.sha256(original.read_bytes()).hexdigest()
    part = httpx.get(url, headers={"Authorization": f"Bearer {admin}", "Range": "bytes=4-9"})
    assert part.status_code == 206 and part.content == original.read_bytes()[4:10]
    missing = httpx.head(server.url + "/api/models/no-such/file", headers={"Authorization": f"Bearer {NODE_KEY}"})
    assert missing.status_code == 404


def test_a_node_fetches_resumes_and_checks_the_file(served: tuple[Server, Path, str], tmp_path: Path) -> None:
    server, original, _ = served
    content = original.read_bytes()
    model = ModelConfig(name="shared", path=Path("~/absent-on-this-node/shared.gguf"))
    cache = tmp_path / "node-cache"
    seen: list[int] = []
    # A download cut at a third: what was written stays, and the next one asks only for the rest.
    checksum = hashlib.sha256(content).hexdigest()
    partial = cache / "from-gateway" / checksum[:32] / "shared.gguf.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(content[: len(content) // 3])
    fetched = fetch_from_gateway(model, server.url, NODE_KEY, cache, lambda done, total: seen.append(done))
    assert fetched.read_bytes() == content and not partial.exists()
    assert seen[0] > len(content) // 3 and seen[-1] == len(content)  # it went on from the cut
    assert fetch_from_gateway(model, server.url, NODE_KEY, cache) == fetched  # kept: not fetched again
    # A partial copy that is not the gateway's file: found by its checksum, removed, fetched whole next time.
    fetched.unlink()
    partial.write_bytes(b"GGUF" + bytes(len(content) // 2))
    with pytest.raises(ModelFileError, match="does not match its SHA-256"):
        fetch_from_gateway(model, server.url, NODE_KEY, cache)
    assert not partial.exists()
    assert fetch_from_gateway(model, server.url, NODE_KEY, cache).read_bytes() == content
    with pytest.raises(ModelFileError, match="HTTP 401"):
        fetch_from_gateway(model, server.url, "not-the-node-key-0123456789", cache)


def test_the_file_route_never_follows_a_link_out_of_the_model_folders(served: tuple[Server, Path, str]) -> None:
    """Issue 82's third row: the model's file replaced by a link to /etc/passwd was answered to the node key."""
    server, original, _ = served
    url = server.url + "/api/models/shared/file"
    node = {"Authorization": f"Bearer {NODE_KEY}"}
    assert httpx.head(url, headers=node).status_code == 200
    original.unlink()
    original.symlink_to("/etc/passwd")
    for method in ("HEAD", "GET"):
        answer = httpx.request(method, url, headers=node)
        assert answer.status_code == 404 and b"root:" not in answer.content, answer.text
    original.unlink()
    original.symlink_to(embedded_model_path().resolve())  # a real GGUF, outside the folders
    assert httpx.head(url, headers=node).status_code == 404
    inside = original.with_name("inside.gguf")  # a link that stays inside is followed
    shutil.copyfile(embedded_model_path(), inside)
    original.unlink()
    original.symlink_to(inside)
    assert httpx.head(url, headers=node).status_code == 200


def test_an_instance_is_not_started_on_a_file_that_became_a_link_out_of_the_folders(
    served: tuple[Server, Path, str],
) -> None:
    """The row was checked when written, and an instance started on the file; the file is checked again as the
    next instance opens it."""
    server, original, admin = served
    headers = {"Authorization": f"Bearer {admin}"}
    answers: list[httpx.Response] = []

    def started_once() -> bool:  # its files are being found just after the model was added
        answers.append(
            httpx.post(server.url + "/api/instances", json={"model": "shared"}, headers=headers, timeout=120)
        )
        return answers[-1].status_code != 502 or "being found" not in answers[-1].text

    assert wait_for(started_once, 30, interval=0.5)
    first = answers[-1]
    assert first.status_code == 201, first.text
    drained = httpx.delete(f"{server.url}/api/instances/{first.json()['instance_id']}", headers=headers, timeout=60)
    assert drained.status_code == 200, drained.text
    original.unlink()
    original.symlink_to(embedded_model_path().resolve())  # a GGUF llama-server would run, outside the folders
    started = httpx.post(server.url + "/api/instances", json={"model": "shared"}, headers=headers, timeout=120)
    assert started.status_code == 502, started.text
    status = httpx.get(server.url + "/api/models/shared", headers=headers).json()
    failure = status["last_start_failure"] or {}
    blocked = f"{status.get('blocked')} {failure.get('message')}"
    assert "leads outside the directories" in blocked, status
    instances = httpx.get(server.url + "/api/instances", headers=headers).json()["data"]
    assert not [i for i in instances if i["model"] == "shared" and i["status"] == "ready"]
