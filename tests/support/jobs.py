"""Helpers of the async-job tests: a client's key, polling a job, and an independent decryption."""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import httpx
from Crypto.Cipher import ChaCha20_Poly1305

from tests.support import Server


def new_key() -> tuple[bytes, str]:
    raw = os.urandom(32)
    return raw, base64.b64encode(raw).decode()


def poll_until_done(server: Server, key: str, tracking_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = httpx.get(server.url + "/api/async_result", params={"tracking_id": tracking_id, "api_key": key})
        assert answer.status_code == 200, answer.text
        if answer.json()["status"] != "pending":
            return dict(answer.json())
        time.sleep(0.2)
    raise AssertionError("job did not finish")


def independent_decrypt(result: str, key: bytes, nonce: bytes) -> bytes:
    data = base64.b64decode(result)
    cipher = ChaCha20_Poly1305.new(key=key, nonce=nonce)  # a 24-byte nonce selects XChaCha20
    return cipher.decrypt_and_verify(data[:-16], data[-16:])
