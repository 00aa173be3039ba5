"""Schemas that would make llama.cpp's grammar hang an instance are refused before admission, each a
400 naming the parameter and the JSON pointer; the instance keeps serving (issue 39, rows 1 and 7)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support import MODEL, assert_error

HANGS = "^((a{0,99}){0,99}){0,99}$"  # held llama-server's main thread for over 11 minutes
OPTIONAL_REPEATED = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(a?){0,1000}$"}}}


def chat_with_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Say a."}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("path", "body", "param", "pointer"),
    [
        ("/v1/chat/completions", chat_with_schema({"pattern": HANGS}), "response_format", "#/pattern"),
        (
            "/v1/chat/completions",
            chat_with_schema(OPTIONAL_REPEATED),
            "response_format",
            "#/properties/code/pattern",
        ),
        (
            "/api/generate",
            {"prompt": "Say a.", "max_tokens": 4, "format": {"type": "string", "pattern": HANGS}},
            "format",
            "#/pattern",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Say a."}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"type": "string", "pattern": HANGS}}}}}],
            },
            "tools.0",
            "#/properties/x/pattern",
        ),
        ("/v1/chat/completions", chat_with_schema(nested(300)), "response_format", "#/properties/a"),
        ("/api/generate", {"prompt": "hi", "format": nested(300)}, "format", "#/properties/a"),
        ("/v1/chat/completions", chat_with_schema({"type": "string", "maxLength": 10**10}), "response_format", "#"),
    ],
    ids=["nested-repetition", "optional-repeated", "native-format", "tool-parameters", "deep", "deep-native", "count"],
)  # fmt: skip
def test_a_schema_too_costly_for_the_grammar_is_400(
    client: httpx.Client, path: str, body: dict[str, Any], param: str, pointer: str
) -> None:
    error = assert_error(client.post(path, json=body), 400, "invalid_request_error", param)
    assert pointer in str(error["message"])


def test_a_pattern_within_the_bound_is_served(client: httpx.Client) -> None:
    """The issue's own example of a fine pattern (0.2 s) is served, and the instance answers after the refusals."""
    answer = client.post(
        "/v1/chat/completions", json=chat_with_schema({"type": "string", "pattern": "^(a{0,30}){0,30}$"})
    )
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["message"]["content"]
    assert set(content.strip('"')) <= {"a"}


# Issue 54, row 3: each was accepted and hung the instance (another key's request waited ~60 s, then 504).
BYPASSES = {
    "empty-lower-count": {"type": "string", "pattern": "^((a{,99}){,99}){,99}$"},
    "spaced-count": {"type": "string", "pattern": "^((a{ 0,99}){0,99 }){ 0,99}$"},
    "empty-class-first": {"type": "string", "pattern": "^(?:[]|b)((a{0,99}){0,99}){0,99}(?:[]|c)$"},
    "property-named-enum": {
        "type": "object",
        "properties": {"enum": {"type": "string", "pattern": "^((a{0,99}){0,99}){0,99}$"}},
    },
    "large-enum": {"type": "string", "enum": [f"v{i}" for i in range(50_000)]},
    "many-branches": {"anyOf": [{"type": "string", "pattern": "^(a{0,30}){0,30}$"} for _ in range(50)]},
}
SURFACES = {
    "chat-response-format": ("/v1/chat/completions", "response_format", lambda s: chat_with_schema(s)),
    "chat-tools-required": ("/v1/chat/completions", "tools.0", lambda s: {
        "messages": [{"role": "user", "content": "Say a."}], "max_tokens": 4, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": s}}}}],
    }),
    "responses-text-format": ("/v1/responses", "text.format", lambda s: {
        "input": "Say a.", "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": s}},
    }),
    "anthropic-tools": ("/v1/messages", "tools.0", lambda s: {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Say a."}],
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": s}}}],
        "tool_choice": {"type": "any"},
    }),
    "native-format": ("/api/generate", "format", lambda s: {"prompt": "Say a.", "max_tokens": 4, "format": s}),
}  # fmt: skip


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("bypass", BYPASSES)
def test_the_grammar_guard_bypasses_are_refused_on_every_surface(
    client: httpx.Client, surface: str, bypass: str
) -> None:
    path, param, body = SURFACES[surface]
    answer = client.post(path, json=body(BYPASSES[bypass]))
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    if path == "/v1/messages":  # Anthropic's error shape has no param: the message names the place
        assert error["message"].startswith(f"{param}"), error
    else:
        assert error["param"] == param, error
