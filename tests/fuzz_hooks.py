"""Schemathesis checks of our own (loaded with SCHEMATHESIS_HOOKS=tests.fuzz_hooks): every error,
whatever the input, is the one envelope with its status as `code`."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def error_envelope(ctx: Any, response: Any, case: Any) -> None:
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) <= {"message", "type", "code", "param"}, error
    assert error["code"] == response.status_code, error
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
