"""A prompt too long for the model's context is refused before it waits for a slot (issue 55: 140 s on
a busy instance, after the agent had given up): counted by an instance's own template and tokenizer
while its one slot is still generating, and answered in each API's own words."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.support import COUNTING, MODEL, Server, assert_error, busy_slots, create_key, wait_for

CONFIG = f"""
limits.max_tokens = 2048
[[models]]
name = "{MODEL}"
parallel = 1
instance_queue = 0
ctx_size = 512
"""
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # about 1,200 tokens: over 512, a bound over 4 KB


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    server = Server(data_dir=tmp_path_factory.mktemp("context"), config=CONFIG).start()
    key = create_key(server.data_dir, "context")
    yield server, key
    server.stop()


def occupied(server: Server, key: str) -> threading.Thread:
    """The instance's only slot, generating for a while."""
    body = {"prompt": COUNTING, "raw": True, "max_tokens": 400}
    thread = threading.Thread(target=lambda: httpx.post(
        server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120))  # fmt: skip
    thread.start()
    assert wait_for(lambda: busy_slots(server) == 1, 30)
    return thread


def test_a_too_long_prompt_is_refused_while_the_slot_is_busy(busy: tuple[Server, str]) -> None:
    server, key = busy
    headers = {"Authorization": f"Bearer {key}"}
    thread = occupied(server, key)
    try:
        chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
        error = assert_error(httpx.post(server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=120),
                             400, "context_length_exceeded", "messages")  # fmt: skip
        assert busy_slots(server) == 1  # refused before the queue: the slot is still the other request's
        assert "maximum context length is 512 tokens" in str(error["message"])
        anthropic = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": LONG}]}
        answer = httpx.post(server.url + "/v1/messages", json=anthropic, headers={"x-api-key": key}, timeout=120)
        assert answer.status_code == 400
        refusal = answer.json()
        assert refusal["type"] == "error" and refusal["error"]["type"] == "invalid_request_error"
        assert refusal["error"]["message"].startswith("prompt is too long: ")
        assert refusal["error"]["message"].endswith(" tokens > 512 maximum")
        assert busy_slots(server) == 1
    finally:
        thread.join()


def test_a_prompt_that_fits_is_served(busy: tuple[Server, str]) -> None:
    server, key = busy
    chat = {"messages": [{"role": "user", "content": LONG[:1500]}], "max_tokens": 4}  # over the bound, under 512
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"},
                        timeout=120)  # fmt: skip
    assert answer.status_code == 200, answer.text
