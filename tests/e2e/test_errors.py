"""Every bad input gets the envelope with the exact status and type."""

from __future__ import annotations

import httpx
import pytest

from tests.support import COUNTING, Server, assert_error

INVALID_KEY = {"error": {"message": "Invalid API key", "type": "authentication_error", "code": 401}}


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/generate"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Bearer", "Basic dXNlcjpwYXNz"])
def test_missing_or_wrong_key_is_401_exactly(server: Server, method: str, path: str, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
    assert response.status_code == 401
    assert response.json() == INVALID_KEY


def test_bad_key_wins_over_a_bad_body(server: Server) -> None:
    response = httpx.post(server.url + "/api/generate", content=b"{not json", headers={"Authorization": "Bearer nope"})
    assert response.json() == INVALID_KEY


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("top_k", -1),
        ("top_p", 0),
        ("top_p", 1.01),
        ("max_tokens", 0),
        ("repeat_penalty", 0),
        ("repeat_penalty", -1),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", "not a list"),
        ("prompt", ""),
        ("raw", "yes please"),
        ("mode", "later"),
    ],
)
def test_invalid_native_parameters(client: httpx.Client, field: str, value: object) -> None:
    response = client.post("/api/generate", json={"prompt": "hi", field: value})
    error = assert_error(response, 400, "invalid_request_error", field)
    assert field in str(error["message"])


def test_max_tokens_over_the_configured_cap_is_the_cap(client: httpx.Client) -> None:
    """An upper bound is clamped, not refused (issue 55: agents ask for 32,000): the answer ends at the
    server's most (512 here) with the finish reason that says so."""
    answer = client.post("/api/generate", json={"prompt": COUNTING, "raw": True, "max_tokens": 100_000})
    assert answer.status_code == 200, answer.text
    assert answer.json()["completion_tokens"] == 512
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["1", "2", "3", "4", "5"]}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({}, "messages"),
    ],
)
def test_invalid_chat_parameters(client: httpx.Client, body: dict[str, object], param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, "invalid_request_error", param)


def test_missing_prompt(client: httpx.Client) -> None:
    assert_error(client.post("/api/generate", json={"max_tokens": 3}), 400, "invalid_request_error", "prompt")
    assert_error(client.post("/v1/completions", json={"max_tokens": 3}), 400, "invalid_request_error", "prompt")


def test_unknown_model_is_404_naming_it(client: httpx.Client) -> None:
    for path, body in [
        ("/api/generate", {"prompt": "hi", "model": "gpt-9"}),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
    ]:
        error = assert_error(client.post(path, json=body), 404, "model_not_found", "model")
        assert "gpt-9" in str(error["message"])


def test_prompt_longer_than_the_context(client: httpx.Client) -> None:
    long_prompt = "apple banana cherry " * 600  # about 1,800 tokens; the test model's context is 1,024
    error = assert_error(
        client.post("/api/generate", json={"prompt": long_prompt, "max_tokens": 4}),
        400,
        "context_length_exceeded",
        "prompt",  # the native API's name for it
    )
    assert "1024" in str(error["message"])
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "context_length_exceeded", "messages")
    # A stream that cannot start is an HTTP error, not an event.
    streamed = client.post("/v1/chat/completions", json={**chat, "stream": True})
    assert_error(streamed, 400, "context_length_exceeded", "messages")
    completion = {"prompt": long_prompt, "max_tokens": 4}
    assert_error(client.post("/v1/completions", json=completion), 400, "context_length_exceeded", "prompt")


def test_body_over_the_limit_is_413(client: httpx.Client) -> None:
    big = {"prompt": "x" * (24 * 1024 * 1024 + 10)}
    assert_error(client.post("/api/generate", json=big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(24 * 1024 + 100):
            yield b"x" * 1024
        yield b'"}'

    assert_error(client.post("/api/generate", content=chunks()), 413, "request_too_large")


def test_malformed_bodies(client: httpx.Client) -> None:
    assert_error(client.post("/api/generate", content=b"{not json"), 400, "invalid_request_error")
    assert_error(client.post("/api/generate", json=[1, 2]), 400, "invalid_request_error")
    # curl -d sends JSON labelled as a form: it is read as JSON all the same.
    curl_like = client.post(
        "/api/generate",
        content=b'{"prompt": "hi", "max_tokens": 1}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert curl_like.status_code == 200


def test_unknown_paths_and_methods(client: httpx.Client) -> None:
    assert_error(client.get("/no/such/path"), 404, "not_found_error")
    assert_error(client.get("/api/generate"), 405, "invalid_request_error")
    # The generation endpoints' lane (api/hot.py) takes POST only; the rest is FastAPI's, as before.
    assert_error(client.get("/v1/chat/completions"), 405, "invalid_request_error")
    assert_error(client.put("/v1/completions", json={}), 405, "invalid_request_error")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/generate", {"prompt": "Say hi.", "n_predict": 100}),
        ("/api/generate", {"prompt": "Say hi.", "grammar": 'root ::= "x"'}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n_probs": 5}),
        ("/v1/completions", {"prompt": "hi", "grammar": 'root ::= "x"'}),
    ],
)
def test_unknown_fields_are_refused_by_name(client: httpx.Client, path: str, body: dict[str, object]) -> None:
    unknown = next(name for name in body if name not in ("prompt", "messages"))
    error = assert_error(client.post(path, json=body), 400, "invalid_request_error", unknown)
    assert error["message"] == f"Unrecognized request argument supplied: {unknown}"
