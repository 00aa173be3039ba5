"""A request body read as json would read it: orjson takes the common case, json the rest (api/deps)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fuzz.run import CORPUS
from llmserver.api.deps import parse_json
from llmserver.errors import InvalidRequest

BODIES = [
    b'{"max_tokens": 123456789012345678901234567890}',  # past 64 bits: orjson would make it a float
    b'{"seed": 18446744073709551616, "n": -9223372036854775809}',
    b'{"seed": 9223372036854775807}',
    b'{"temperature": NaN, "top_p": Infinity, "min_p": -Infinity}',
    b'{"repeat_penalty": 1e400}',
    b'\xef\xbb\xbf{"prompt": "hi"}',  # a byte order mark
    '{"prompt": "h\u00e9"}'.encode("utf-16"),
    '{"prompt": "h\u00e9"}'.encode("utf-32-le"),
    b'{"prompt": "\\ud83d\\ude00", "a": 1, "a": 2}',  # a surrogate pair; a repeated name (the last wins)
    b' {"messages": [{"role": "user", "content": "hi"}], "stop": null, "x": [1.5, -0, 1e-400]} ',
]


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (1 == 1.0 is not enough), NaN equal to itself."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


@pytest.mark.parametrize("raw", BODIES + sorted(p.read_bytes() for p in (CORPUS / "body").iterdir()))
def test_a_body_reads_as_json_reads_it(raw: bytes) -> None:
    try:
        expected = json.loads(raw)
    except (ValueError, RecursionError):
        expected = None
    if not isinstance(expected, dict):
        with pytest.raises(InvalidRequest):
            parse_json(raw)
        return
    try:
        body = parse_json(raw)
    except InvalidRequest as exc:  # json's reading, refused: only for a lone surrogate
        assert "surrogate" in exc.message
        return
    assert same(body, expected)


def test_an_integer_past_64_bits_keeps_every_digit() -> None:
    body = parse_json(b'{"max_tokens": 123456789012345678901234567890}')
    assert body["max_tokens"] == 123456789012345678901234567890


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "must be a JSON object"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"a": 1', "not valid JSON"),
        (b'{"a": "\\udc00"}', "surrogate"),
        (b'{"a": "\xff"}', "not valid JSON"),
        (b"[" * 100_000, "nests"),
    ],
)
def test_what_is_not_a_json_object_is_refused_with_json_s_words(raw: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_json(raw)
    assert words in caught.value.message
