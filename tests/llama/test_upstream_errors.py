"""llama-server's error objects map to our envelope by their structured type."""

from __future__ import annotations

from llmserver.errors import ContextLengthExceeded, InvalidRequest, UpstreamError
from llmserver.llama.client import upstream_error


def test_context_overflow_names_the_excess() -> None:
    error = upstream_error(
        {
            "error": {
                "code": 400,
                "type": "exceed_context_size_error",
                "message": "x",
                "n_prompt_tokens": 1500,
                "n_ctx": 1024,
            }
        },
        400,
    )
    assert isinstance(error, ContextLengthExceeded)
    assert error.body()["error"]["type"] == "context_length_exceeded"
    assert "1500" in error.message and "476 more" in error.message and "1024" in error.message


def test_bad_request_and_server_failure() -> None:
    assert isinstance(
        upstream_error({"error": {"code": 400, "type": "invalid_request_error", "message": "m"}}, 400), InvalidRequest
    )
    failed = upstream_error({"error": {"code": 500, "type": "server_error", "message": "boom"}}, 500)
    assert isinstance(failed, UpstreamError) and failed.status == 502
    assert isinstance(upstream_error("not an object", 500), UpstreamError)
