"""Streams end cleanly, and a client that goes away frees the instance's slot."""

from __future__ import annotations

import concurrent.futures
import json

import httpx

from tests.support import COUNTING, MODEL, Server, busy_slots, wait_for


def test_client_disconnect_frees_the_slot(server: Server, client: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 500,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert busy_slots(server) == 1
    assert wait_for(lambda: busy_slots(server) == 0, 5)
    # and the server goes on serving
    assert client.post("/api/generate", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_concurrent_streams_are_independent(server: Server, api_key: str) -> None:
    def run(seed: int) -> str:
        body = {"prompt": "List some fruits:", "max_tokens": 12, "temperature": 0, "stream": True, "seed": seed}
        headers = {"Authorization": f"Bearer {api_key}"}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(run, range(4)))
    assert len(set(texts)) == 1 and texts[0]  # temperature 0: the same text on every slot


def _cancellations(server: Server) -> int:
    return sum(
        log.read_text(errors="replace").count("stop: cancel task") for log in (server.data_dir / "logs").glob("*.log")
    )


def test_non_streamed_disconnect_frees_the_slot(server: Server, api_key: str) -> None:
    body = {"prompt": COUNTING, "raw": True, "max_tokens": 512, "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"}
    cancelled_before = _cancellations(server)
    try:
        httpx.post(server.url + "/api/generate", json=body, headers=headers, timeout=1.0)
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection mid-generation
    else:
        raise AssertionError("the generation should outlast the client's 1 s timeout")
    # The gateway cancels its call at once; llama-server notices the closed connection by polling it
    # (about once a second here, but seen to lag up to 7 s on this loaded 2-core machine) and cancels
    # the task: it says so in its log, before the 512 tokens could have been generated.
    assert wait_for(lambda: _cancellations(server) > cancelled_before, 20)
    assert wait_for(lambda: busy_slots(server) == 0, 5)
    assert "POST /api/generate 499" in server.log()
