"""The stand-in for llama-server of `bench/instant.py` (an upstream that answers at once, to measure the
gateway's own cost): llmserver runs it as its llama-server and serves chat completions through it."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench import instant
from tests.support import MODEL, Server, create_key


def test_llmserver_serves_through_the_instant_stand_in(tmp_path: Path) -> None:
    script = instant.upstream_script(tmp_path)
    config = f'instances.llama_server_path = "{script}"\n[[models]]\nname = "{MODEL}"\nparallel = 2\n'
    server = Server(data_dir=tmp_path / "data", config=config).start(timeout=60)
    try:
        key = create_key(server.data_dir, "instant")
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == "Hi"
        assert body["usage"]["prompt_tokens"] == 9 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
        assert answer.headers["x-llmserver-instance"]
    finally:
        assert server.stop() == 0, server.log()[-2000:]
