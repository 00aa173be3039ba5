"""Async mode against the real server: submit, poll once, decrypt independently, webhooks, fallback."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmserver.client import Client, JobGone
from tests.support import COUNTING, MODEL, Server, cli, make_key, store_rows, wait_for
from tests.support.jobs import independent_decrypt, new_key, poll_until_done
from tests.support.receiver import Receiver

GONE = {
    "error": {
        "message": "Unknown tracking_id, expired, or its result was already consumed — stop polling.",
        "type": "not_found_error",
        "code": 404,
    }
}
ASYNC_CONFIG = f"""
jobs.sync_timeout = 1.5
jobs.webhook_allow_private = true
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
"""
BODY = {"prompt": "Name three colors.", "max_tokens": 16, "temperature": 0, "seed": 1}
LONG = {"prompt": COUNTING, "raw": True, "max_tokens": 250, "temperature": 0}


@pytest.fixture(scope="module")
def async_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(data_dir=tmp_path_factory.mktemp("async"), config=ASYNC_CONFIG).start()
    yield server
    server.stop()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


def test_submit_poll_once_and_decrypt(async_server: Server) -> None:
    key = make_key(async_server.data_dir, "async")
    raw, encoded = new_key()
    submitted = httpx.post(
        async_server.url + "/api/generate", json={**BODY, "api_key": key, "mode": "async", "key": encoded}
    )
    assert submitted.status_code == 200, submitted.text
    payload = submitted.json()
    assert set(payload) == {"mode", "tracking_id", "method", "nonce"}
    assert payload["mode"] == "async" and payload["method"] == "xchacha20"
    nonce = base64.b64decode(payload["nonce"])
    assert len(nonce) == 24
    done = poll_until_done(async_server, key, payload["tracking_id"])
    assert set(done) == {"status", "result"} and done["status"] == "ready"
    plain = json.loads(independent_decrypt(done["result"], raw, nonce))
    sync = httpx.post(
        async_server.url + "/api/generate", json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    expected = sync.json()
    if expected.get("mode") == "async":  # a machine slow enough to pass sync_timeout: the same answer, as a job
        result = poll_until_done(async_server, key, expected["tracking_id"])["result"]
        expected = json.loads(
            independent_decrypt(result, base64.b64decode(expected["key"]), base64.b64decode(expected["nonce"]))
        )
    assert set(plain) == set(expected)
    assert plain["response"] == expected["response"] and plain["completion_tokens"] == expected["completion_tokens"]
    again = httpx.get(
        async_server.url + "/api/async_result", params={"tracking_id": payload["tracking_id"], "api_key": key}
    )
    assert again.status_code == 404 and again.json() == GONE


def test_other_keys_and_unknown_ids_get_the_same_404(async_server: Server) -> None:
    owner, other = make_key(async_server.data_dir, "owner"), make_key(async_server.data_dir, "other")
    _, encoded = new_key()
    submitted = httpx.post(
        async_server.url + "/api/generate",
        json={**BODY, "mode": "async", "key": encoded},
        headers={"Authorization": f"Bearer {owner}"},
    ).json()
    for key, tracking_id in [(other, submitted["tracking_id"]), (owner, "10de8f98-88b9-4138-9443-dc14da61150d")]:
        answer = httpx.get(
            async_server.url + "/api/async_result",
            params={"tracking_id": tracking_id},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 404 and answer.json() == GONE
    assert poll_until_done(async_server, owner, submitted["tracking_id"])["status"] == "ready"  # the owner still can
    no_key = httpx.get(async_server.url + "/api/async_result", params={"tracking_id": submitted["tracking_id"]})
    assert no_key.status_code == 401


@pytest.mark.parametrize("bad_key", [None, "", "c2hvcnQ=", base64.b64encode(b"k" * 33).decode(), "!!!"])
def test_bad_async_keys_are_400_naming_key(async_server: Server, bad_key: str | None) -> None:
    key = make_key(async_server.data_dir, "bad-keys")
    body: dict[str, Any] = {**BODY, "mode": "async", "api_key": key}
    if bad_key is not None:
        body["key"] = bad_key
    answer = httpx.post(async_server.url + "/api/generate", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "key"
    assert not bad_key or bad_key not in error["message"]


def test_openai_endpoints_take_the_async_extension(async_server: Server) -> None:
    key = make_key(async_server.data_dir, "openai-async")
    raw, encoded = new_key()
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "mode": "async", "key": encoded}
    payload = httpx.post(
        async_server.url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"}
    ).json()
    done = poll_until_done(async_server, key, payload["tracking_id"])
    plain = json.loads(independent_decrypt(done["result"], raw, base64.b64decode(payload["nonce"])))
    assert plain["object"] == "chat.completion" and plain["choices"][0]["message"]["content"]
    streamed = httpx.post(
        async_server.url + "/v1/chat/completions",
        json={**chat, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_failed_generation_is_reported_as_failed(async_server: Server) -> None:
    key = make_key(async_server.data_dir, "fails")
    _, encoded = new_key()
    too_long = {
        "prompt": "apple banana cherry " * 600,
        "max_tokens": 4,
        "mode": "async",
        "key": encoded,
        "api_key": key,
    }
    payload = httpx.post(async_server.url + "/api/generate", json=too_long).json()
    done = poll_until_done(async_server, key, payload["tracking_id"])
    assert (
        done["status"] == "failed"
        and done["error"]["type"] == "context_length_exceeded"
        and done["error"]["code"] == 400
    )


def test_sync_request_past_sync_timeout_falls_back_to_async(start_server: Callable[..., Server]) -> None:
    # 250 tokens take about 1.7 s here: 0.2 s is far from any machine's speed.
    server = start_server(ASYNC_CONFIG.replace("jobs.sync_timeout = 1.5", "jobs.sync_timeout = 0.2"))
    key = make_key(server.data_dir, "fallback")
    answer = httpx.post(server.url + "/api/generate", json={**LONG, "api_key": key}, timeout=60)
    assert answer.status_code == 200
    payload = answer.json()
    assert set(payload) == {"mode", "tracking_id", "method", "nonce", "key"}
    done = poll_until_done(server, key, payload["tracking_id"])
    plain = json.loads(
        independent_decrypt(done["result"], base64.b64decode(payload["key"]), base64.b64decode(payload["nonce"]))
    )
    assert plain["completion_tokens"] == LONG["max_tokens"]  # the whole generation, not what was done at 0.2 s
    assert plain["response"].startswith(" 11,")


def test_webhook_delivery_retries_and_does_not_consume(async_server: Server, receiver: Receiver) -> None:
    receiver.fail_first = 2
    key = make_key(async_server.data_dir, "hooked")
    raw, encoded = new_key()
    body = {**BODY, "mode": "async", "key": encoded, "webhook_url": receiver.url, "api_key": key}
    payload = httpx.post(async_server.url + "/api/generate", json=body).json()
    assert wait_for(lambda: receiver.received, 30)
    assert receiver.attempts == 3  # two 503s, then accepted
    (delivered,) = receiver.received
    assert delivered == {"status": "ready", "tracking_id": payload["tracking_id"], "result": delivered["result"]}
    json.loads(independent_decrypt(delivered["result"], raw, base64.b64decode(payload["nonce"])))
    polled = poll_until_done(async_server, key, payload["tracking_id"])  # the webhook did not consume it
    assert polled == {"status": "ready", "result": delivered["result"]}


def test_private_webhook_is_refused_by_default(server: Server, api_key: str, receiver: Receiver) -> None:
    _, encoded = new_key()
    body = {**BODY, "mode": "async", "key": encoded, "webhook_url": receiver.url}
    answer = httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {api_key}"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "webhook_url" and "private" in error["message"] and "127.0.0.1" not in error["message"]
    assert receiver.attempts == 0


def job_rows(data_dir: Path, tracking_id: str) -> list[tuple[str]]:
    return [
        (row["status"],) for row in store_rows(data_dir, "SELECT status FROM jobs WHERE tracking_id = ?", tracking_id)
    ]


def test_expired_results_are_404(start_server: Callable[..., Server]) -> None:
    server = start_server(
        f'jobs.result_ttl = 1\njobs.sweep_interval = 0.5\n[[models]]\nname = "{MODEL}"\nctx_size = 512\n'
    )
    key = make_key(server.data_dir, "late")
    _, encoded = new_key()
    payload = httpx.post(
        server.url + "/api/generate", json={**BODY, "mode": "async", "key": encoded, "api_key": key}
    ).json()
    params = {"tracking_id": payload["tracking_id"], "api_key": key}
    # Not polled while it runs (a poll of the ready result would consume it): wait for the log.
    assert wait_for(lambda: f"async job {payload['tracking_id']} ready" in server.log(), 20)
    # Past the 1 s TTL the sweep deletes it (polling before would consume it), and a poll is 404.
    assert wait_for(lambda: not job_rows(server.data_dir, payload["tracking_id"]), 10)
    answer = httpx.get(server.url + "/api/async_result", params=params)
    assert answer.status_code == 404 and answer.json() == GONE


def stopped_while_running(
    tmp_path: Path, start_server: Callable[..., Server], drain_timeout: int, max_tokens: int
) -> tuple[str, dict[str, Any], dict[str, str], bytes, Server]:
    """A server stopped (SIGTERM) while an async job of `max_tokens` runs: its config, the submit
    answer, the poll parameters, the client key, and the stopped server."""
    config = f'server.drain_timeout = {drain_timeout}\n[[models]]\nname = "{MODEL}"\nctx_size = 1024\n'
    first = start_server(config, data_dir=tmp_path)
    key = make_key(tmp_path, "stopped")
    raw, encoded = new_key()
    body = {**LONG, "max_tokens": max_tokens, "mode": "async", "key": encoded, "api_key": key}
    payload = httpx.post(first.url + "/api/generate", json=body).json()
    params = {"tracking_id": payload["tracking_id"], "api_key": key}
    assert httpx.get(first.url + "/api/async_result", params=params).json() == {"status": "pending"}
    first.stop()
    return config, payload, params, raw, first


def test_a_stop_lets_running_jobs_finish_within_drain_timeout(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    config, payload, params, raw, first = stopped_while_running(tmp_path, start_server, 60, 150)
    assert "waiting up to 60 s for 1 async jobs to finish" in first.log()
    second = start_server(config, data_dir=tmp_path)
    done = httpx.get(second.url + "/api/async_result", params=params).json()
    assert done["status"] == "ready", done
    plain = json.loads(independent_decrypt(done["result"], raw, base64.b64decode(payload["nonce"])))
    assert plain["completion_tokens"] == 150


def test_restart_turns_running_jobs_into_failed_ones(tmp_path: Path, start_server: Callable[..., Server]) -> None:
    config, _, params, _, _ = stopped_while_running(tmp_path, start_server, 0, 400)
    second = start_server(config, data_dir=tmp_path)
    answer = httpx.get(second.url + "/api/async_result", params=params).json()
    assert answer["status"] == "failed" and "submit it again" in answer["error"]["message"]


def test_no_key_or_plaintext_lands_on_disk(async_server: Server, receiver: Receiver) -> None:
    key = make_key(async_server.data_dir, "secrets")
    raw, encoded = new_key()
    body = {
        "prompt": "Write one sentence about owls.",
        "max_tokens": 24,
        "temperature": 0,
        "mode": "async",
        "key": encoded,
    }
    payload = httpx.post(
        async_server.url + "/api/generate", json={**body, "api_key": key, "webhook_url": receiver.url}
    ).json()
    done = poll_until_done(async_server, key, payload["tracking_id"])
    plaintext = independent_decrypt(done["result"], raw, base64.b64decode(payload["nonce"]))
    text = json.loads(plaintext)["response"].strip()
    assert len(text) > 10
    secrets = [raw, encoded.encode(), base64.urlsafe_b64encode(raw), raw.hex().encode(), plaintext, text.encode()]
    for path in async_server.data_dir.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for secret in secrets:
                assert secret not in content, f"{secret[:12]!r}… found in {path}"


def test_python_client_and_ask_command(async_server: Server) -> None:
    key = make_key(async_server.data_dir, "client")
    client = Client(async_server.url, api_key=key)
    direct = client.generate(BODY["prompt"], max_tokens=16, temperature=0, seed=1)
    assert client.generate_async(BODY["prompt"], max_tokens=16, temperature=0, seed=1)["response"] == direct["response"]
    fallback = client.generate(LONG["prompt"], raw=True, max_tokens=200, temperature=0)  # passes sync_timeout: followed
    assert fallback["completion_tokens"] == 200
    job = client.submit("Say hi.", max_tokens=4)
    client.result(job)
    with pytest.raises(JobGone):
        client.result(job)  # consumed: 404, and the client stops
    asked = cli(
        async_server.data_dir, "ask", "--url", async_server.url, "--key", key, "--async", "--max-tokens", "8", "Say hi."
    )
    assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    refused = cli(async_server.data_dir, "ask", "--url", async_server.url, "--key", "wrong", "hi")
    assert refused.returncode == 1 and refused.stderr == "Error: Invalid API key (401 authentication_error)\n"
