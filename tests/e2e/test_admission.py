"""Admission before any work, through the real server: a key over its quota or its requests per
minute gets its 429 in milliseconds whatever it attached, and no file is extracted for it."""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import (
    MODEL,
    Server,
    assert_error,
    create_key,
    documents,
    make_key_record,
    metric,
    use_total_quota,
    wait_for,
)

# This module starts a server of its own (the default 128 MiB body limit): selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

CONFIG = f'[[models]]\nname = "{MODEL}"\nparallel = 2\nctx_size = 1024\n'
TRIES = 20
EXTRACTED = "llmserver_file_extractions_total"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    server = Server(data_dir=tmp_path_factory.mktemp("admission"), config=CONFIG).start()
    yield server, create_key(server.data_dir, "admin", admin=True)
    server.stop()


def big_files_body(path: Path) -> Path:
    """Five 14 MB files in one chat request: 98 MB of JSON, written to `path`."""
    data = "data:application/pdf;base64," + base64.b64encode(os.urandom(14 * 1024 * 1024)).decode()
    parts = [{"type": "file", "file": {"filename": f"big-{i}.pdf", "data": data}} for i in range(5)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Summarise."}]}]}
    path.write_bytes(json.dumps(body).encode())
    return path


def timed_refusals(server: Server, key: str, body: Path, type_: str) -> list[float]:
    """POST `body` TRIES times with curl; each must be a 429 of `type_`. curl's seconds for each."""
    seconds = []
    for _ in range(TRIES):
        done = subprocess.run(
            ["curl", "-s", "-w", "\n%{time_total}", "-H", f"Authorization: Bearer {key}",
             "-H", "Content-Type: application/json", "--data-binary", f"@{body}",
             server.url + "/v1/chat/completions"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        answer, took = done.stdout.rsplit("\n", 1)
        error = json.loads(answer)["error"]
        assert (error["type"], error["code"]) == (type_, 429), answer
        seconds.append(float(took))
    return seconds


def test_keys_over_quota_or_rpm_get_429_in_milliseconds_and_nothing_is_extracted(
    gateway: tuple[Server, str], tmp_path: Path
) -> None:
    server, admin = gateway
    body = big_files_body(tmp_path / "body.json")
    spent_id, spent = make_key_record(server.data_dir, "spent", quota_tokens=1000, quota_period="total")
    use_total_quota(server.data_dir, spent_id, 1000)
    _, hasty = make_key_record(server.data_dir, "hasty", rpm=1)
    first = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"Authorization": f"Bearer {hasty}"},
        timeout=60,
    )
    assert first.status_code == 200  # its one request of this minute

    over_quota = timed_refusals(server, spent, body, "insufficient_quota")
    over_rpm = timed_refusals(server, hasty, body, "rate_limit_error")
    print(  # the figures the closing note quotes
        f"\n429 for 5 x 14 MB files: over quota p50 {statistics.median(over_quota) * 1000:.1f} ms, "
        f"over rpm p50 {statistics.median(over_rpm) * 1000:.1f} ms"
    )
    assert statistics.median(over_quota) < 0.1 and statistics.median(over_rpm) < 0.1
    # A client that sends its whole body before reading (httpx) gets the same envelope.
    with httpx.Client(timeout=60) as client:
        sent = client.post(
            server.url + "/v1/chat/completions",
            content=body.read_bytes(),
            headers={"Authorization": f"Bearer {spent}", "Content-Type": "application/json"},
        )
    assert_error(sent, 429, "insufficient_quota")
    assert metric(server, admin, EXTRACTED) == 0  # no extraction child was ever started

    # The same kind of request from a key with room is extracted: the counter above can move.
    small = documents.file_part("note.txt", b"A short note.")
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [small]}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {create_key(server.data_dir, 'roomy')}"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert metric(server, admin, EXTRACTED, outcome="ok") == 1


def test_a_request_whose_bound_does_not_fit_is_refused_before_extraction(gateway: tuple[Server, str]) -> None:
    server, admin = gateway
    before = metric(server, admin, EXTRACTED)
    _, small = make_key_record(server.data_dir, "small", quota_tokens=300, quota_period="total")
    big = documents.file_part("big.txt", b"x" * 20_000)  # 20,000 bytes: its bound alone is over 300
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [big]}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {small}"},
        timeout=60,
    )
    assert_error(response, 429, "insufficient_quota")
    assert metric(server, admin, EXTRACTED) == before


def test_text_that_outgrows_its_bound_is_refused_after_extraction(gateway: tuple[Server, str]) -> None:
    """A tiny ZIP holds 5,000 bytes of text: its bound from its size fits the quota, its real text
    does not. 429 before anything reaches an instance, and the reservation is given back."""
    server, admin = gateway
    _, key = make_key_record(server.data_dir, "squeezed", quota_tokens=700, quota_period="total")
    packed = documents.make_zip({"notes.txt": b"a" * 5_000})
    assert len(packed) < 300
    body = {"messages": [{"role": "user", "content": [documents.file_part("notes.zip", packed)]}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    error = assert_error(response, 429, "insufficient_quota")
    assert "700 are left" in str(error["message"])
    assert metric(server, admin, EXTRACTED, outcome="ok") >= 1
    usage = httpx.get(server.url + "/api/usage", headers=headers).json()
    assert usage["by_outcome"] == {"insufficient_quota": 1} and usage["total_tokens"] == 0
    assert httpx.get(server.url + "/v1/models", headers=headers).headers["x-ratelimit-remaining-tokens"] == "700"


def test_one_key_saturating_a_model_does_not_starve_another(gateway: tuple[Server, str]) -> None:
    """Key A sends 8 long requests to a model of 2 slots and 2 instance-queue places: 4 handed to the
    instance, 4 waiting. Key B's short request then takes the first place that frees, ahead of A's
    backlog: it starts once 3 of A's requests have ended (the one whose end freed the place, and the
    two ahead of it in llama-server's own queue), and its 2 tokens are done before A's fifth ends.
    First come first served, B waited for A's whole backlog to be handed over first: it started after
    A's seventh ended (issue 39, row 2)."""
    import threading

    server, admin = gateway
    heavy, light = create_key(server.data_dir, "heavy"), create_key(server.data_dir, "light")
    done: list[str] = []
    lock = threading.Lock()

    def send(key: str, name: str, max_tokens: int) -> None:
        body = {"prompt": "1, 2, 3, 4,", "max_tokens": max_tokens, "temperature": 0}
        answer = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                            timeout=300)  # fmt: skip
        assert answer.status_code == 200, answer.text
        with lock:
            done.append(name)

    backlog = [threading.Thread(target=send, args=(heavy, f"A{n}", 160)) for n in range(8)]
    for thread in backlog:
        thread.start()

    def waiting() -> float:
        records = httpx.get(server.url + "/api/instances", headers={"Authorization": f"Bearer {admin}"}).json()
        return float(records["models"][0]["queue_depth"])

    assert wait_for(lambda: waiting() == 4, 60)
    send(light, "B", 2)
    for thread in backlog:
        thread.join()
    assert done.index("B") <= 4, done
