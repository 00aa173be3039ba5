"""Schemathesis checks of our own (loaded with SCHEMATHESIS_HOOKS=tests.support.fuzz_hooks): every error,
whatever the input, is the one envelope with its status as `code` (on Anthropic's Messages paths,
Anthropic's error object; a HEAD's answer has no body)."""

from __future__ import annotations

from typing import Any

import schemathesis

from llmserver.errors import ANTHROPIC_PATHS


@schemathesis.check
def error_envelope(ctx: Any, response: Any, case: Any) -> None:
    if response.status_code < 400 or case.method.upper() == "HEAD":
        return  # a HEAD answer has no body: its envelope is the GET's, checked there
    body = response.json()
    if case.path in ANTHROPIC_PATHS:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        return
    error = body["error"]
    assert set(error) <= {"message", "type", "code", "param"}, error
    assert error["code"] == response.status_code, error
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
