"""What a hostile-but-honest probe found (issue 20's table), each with its exact request: every one
is now a clear error in the envelope, never a 500, a 502 or a held connection."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support import Server, assert_error, documents, make_key_record, use_total_quota, wait_for

LONE = '"\\ud800"'  # a lone surrogate, as JSON spells it
USER_LONE = f'{{"role": "user", "content": {LONE}}}'
SYSTEM_LONE = f'{{"role": "system", "content": {LONE}}}, {{"role": "user", "content": "hi"}}'
PART_LONE = f'{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}'
EXE = documents.file_part("a.exe", b"MZ" + bytes(200), "application/x-msdownload")
BROKEN_PDF = documents.file_part("a.pdf", b"%PDF-1.4 broken", "application/pdf")


def post_raw(server: Server, key: str, path: str, body: str | bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", f'{{"messages": [{USER_LONE}]}}', "messages.0.content"),
        ("/v1/chat/completions", f'{{"messages": [{SYSTEM_LONE}]}}', "messages.0.content"),
        ("/v1/chat/completions", f'{{"messages": [{PART_LONE}]}}', "messages.0.content.0.text"),
        ("/v1/completions", f'{{"prompt": {LONE}}}', "prompt"),
        ("/api/generate", f'{{"prompt": "hi", "system": {LONE}}}', "system"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_the_field(
    server: Server, api_key: str, path: str, body: str, param: str
) -> None:
    error = assert_error(post_raw(server, api_key, path, body), 400, "invalid_request_error", param)
    assert "surrogate" in str(error["message"])


def test_a_paired_surrogate_escape_is_ordinary_text(client: httpx.Client) -> None:
    answer = client.post("/api/generate", content=b'{"prompt": "Say \\ud83d\\ude00.", "max_tokens": 2}')
    assert answer.status_code == 200, answer.text


def test_a_huge_prompt_is_refused_at_the_gateway(client: httpx.Client) -> None:
    body = {"prompt": "x" * (20 * 1024 * 1024), "max_tokens": 4}  # 20 MiB: far over any context
    error = assert_error(client.post("/api/generate", json=body), 400, "context_length_exceeded", "prompt")
    assert "at least" in str(error["message"])
    chat = {"messages": [{"role": "user", "content": "x" * (20 * 1024 * 1024)}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded", "messages")


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000, b'{"a":' * 100_000])
def test_deep_nesting_is_400(server: Server, api_key: str, body: bytes) -> None:
    assert_error(post_raw(server, api_key, "/api/generate", body), 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "hi", "repeat_penalty": 1e400}', "repeat_penalty"),
        ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ('{"prompt": "hi", "top_p": NaN}', "top_p"),
        ('{"prompt": "hi", "max_tokens": "4"}', "max_tokens"),
        ('{"prompt": "hi", "raw": "yes"}', "raw"),
        ('{"prompt": "hi", "seed": 1.5}', "seed"),
    ],
)
def test_numbers_and_types_are_strict(server: Server, api_key: str, body: str, param: str) -> None:
    assert_error(post_raw(server, api_key, "/api/generate", body), 400, "invalid_request_error", param)


def test_stream_must_be_a_boolean(server: Server, api_key: str) -> None:
    body = '{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}'
    assert_error(post_raw(server, api_key, "/v1/chat/completions", body), 400, "invalid_request_error", "stream")


def test_every_refused_request_is_a_ledger_row(server: Server) -> None:
    key_id, key = make_key_record(server.data_dir, "refusals", quota_tokens=5000, quota_period="total")
    headers = {"Authorization": f"Bearer {key}"}

    def refused(body: dict[str, object], status: int, type_: str) -> None:
        answer = httpx.post(server.url + "/api/generate", json=body, headers=headers, timeout=120)
        assert answer.status_code == status and answer.json()["error"]["type"] == type_, answer.text

    refused({"prompt": "hi", "max_tokens": "4"}, 400, "invalid_request_error")
    refused({"prompt": "Summarise.", "files": [EXE]}, 415, "unsupported_media_type")
    refused({"prompt": "Summarise.", "files": [BROKEN_PDF]}, 422, "unprocessable_file")
    use_total_quota(server.data_dir, key_id, 4900)
    refused({"prompt": "hi", "max_tokens": 500}, 429, "insufficient_quota")
    usage = httpx.get(server.url + "/api/usage", headers=headers).json()
    expected = ("invalid_request_error", "unsupported_media_type", "unprocessable_file", "insufficient_quota")
    assert usage["by_outcome"] == dict.fromkeys(expected, 1), usage


def _held(server: Server, request: bytes) -> tuple[float, bytes]:
    """Send a request that never completes: how long until the server closes the connection, and
    what it answered."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(request)
        started = time.monotonic()
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return time.monotonic() - started, received


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /api/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",  # no blank line
        b"POST /api/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 120\r\n\r\n" + b'{"prompt": "hi"}',  # short
    ],
)
def test_a_request_that_stops_arriving_is_closed(start_server: Callable[..., Server], request_bytes: bytes) -> None:
    server = start_server("server.request_read_timeout = 2\n")
    waited, answered = _held(server, request_bytes)
    assert 1.5 < waited < 10, waited
    assert answered == b""
    assert "ClientDisconnect" not in server.log() and "Traceback" not in server.log()
    assert "its request stopped arriving" in server.log()


def test_an_integer_of_over_4300_digits_is_400_naming_its_place(server: Server, api_key: str) -> None:
    """Python refuses to convert such a literal (ValueError): it was a 500, even without a key; now a
    400 naming the field, and without a key the 401 every bad key gets whatever the body."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}"
    headers = {"Authorization": f"Bearer {api_key}"}
    answer = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
    error = assert_error(answer, 400, "invalid_request_error", "seed")
    assert "4300 digits" in str(error["message"])
    anonymous = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30)
    assert_error(anonymous, 401, "authentication_error")


def test_more_messages_than_max_messages_is_400(client: httpx.Client) -> None:
    """40,000 messages took 18 to 22 s of llama-server time before its 400; now the gateway refuses at once."""
    messages = [{"role": "user", "content": "hi"}] * 2049  # max_messages: 2,048 by default
    error = assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, "invalid_request_error")
    assert error["param"] == "messages" and "2048" in str(error["message"])


def test_a_path_cannot_forge_or_break_an_access_log_line(server: Server) -> None:
    """The text access log writes the path %-encoded again: a decoded %0A would start a forged line, a
    raw quote or escape byte would garble the line a reader (or a log shipper) parses."""
    forged = "/v1/nothing%0A2026-01-01 00:00:00,000 ERROR llmserver: forged%1B[31m"
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(f'GET {forged.replace(" ", "%20")}"x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n'.encode())
        assert conn.recv(65536).startswith(b"HTTP/1.1 404")
    shown = "/v1/nothing%0A2026-01-01%2000:00:00,000%20ERROR%20llmserver:%20forged%1B%5B31m%22x"
    assert wait_for(lambda: shown in server.log(), 10), server.log()[-2000:]
    assert "\nforged" not in server.log() and "ERROR llmserver: forged" not in server.log()
    assert "\x1b" not in server.log()
