"""The request helpers every route uses (api/deps.py): headers read from the scope, the key a request sends."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from llmserver.api.deps import header_key, scope_header
from llmserver.asgi_ext import HEADER_INDEX


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": list(headers)}


def test_a_header_is_its_first_value_under_any_server_and_after_a_layer_replaced_the_headers() -> None:
    plain = scope((b"x-a", b"1"), (b"x-a", b"2"))  # no index: another ASGI server made this scope
    assert scope_header(plain, b"x-a") == b"1" and scope_header(plain, b"x-b") is None
    plain["headers"] = [(b"x-b", b"3")]  # a layer gave the request other headers: the index follows them
    assert scope_header(plain, b"x-a") is None and scope_header(plain, b"x-b") == b"3"
    assert plain[HEADER_INDEX][0] is plain["headers"]


def test_the_key_is_the_bearer_token_else_x_api_key() -> None:
    def key(*headers: tuple[bytes, bytes]) -> str | None:
        return header_key(Request(scope(*headers)))

    assert key((b"authorization", b"Bearer  sk-1 "), (b"x-api-key", b"sk-2")) == "sk-1"
    assert key((b"authorization", b"bearer sk-1")) == "sk-1"
    assert key((b"authorization", b"Basic abc"), (b"x-api-key", b"sk-2")) == "sk-2"
    assert key((b"x-api-key", b"sk-2"), (b"x-api-key", b"sk-3")) == "sk-2"
    assert key((b"authorization", b"Bearer ")) is None
    assert key() is None
