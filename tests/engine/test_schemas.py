"""The pattern cost model against the measured table in engine/schemas.py, and the schema walk's bounds."""

from __future__ import annotations

import pytest

from llmserver.engine.schemas import PATTERN_COST, check_schema, pattern_cost
from llmserver.errors import InvalidRequest


@pytest.mark.parametrize(
    ("pattern", "cost"),
    [
        ("^(a{0,100}){0,10}$", 10_000),
        ("^((a{0,7}){0,7}){0,7}$", 16_807),
        ("^(a{0,30}){0,30}$", 27_000),
        ("^(a{0,30}b{0,30}){0,30}$", 54_000),
        ("^((a{0,10}){0,10}){0,10}$", 100_000),
        ("^([a-z]{0,50}){0,20}$", 200_000),
        ("^(a?){0,1000}$", 1_000_000),
        ("^(a{0,2}){0,500}$", 500_000),
        ("^(?:a{0,2}){0,500}$", 500_000),
        ("^(a{0,2}?){0,500}$", 500_000),
        # A body that cannot be empty, or a single repetition, costs nothing however large.
        ("^(a{1,30}){1,30}$", 0),
        ("^a{0,100000}$", 0),
        ("^(a+)+b$", 0),
        ("^((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)$", 0),
        ("^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$", 0),
        ("^\\d{3}-\\d{4}$", 0),
        ("^a{b$", 0),  # a `{` that starts no count is a character
    ],
)
def test_pattern_costs(pattern: str, cost: int) -> None:
    assert pattern_cost(pattern) == cost


def test_the_bound_sits_between_the_measured_fast_and_slow_patterns() -> None:
    assert pattern_cost("^(a{0,30}){0,30}$") <= PATTERN_COST < pattern_cost("^(a{0,30}b{0,30}){0,30}$")


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("^(a$", "not closed"),
        ("^a)$", "unbalanced"),
        ("^[a-$", "not closed"),
        ("^*a$", "repeats nothing"),
        ("^(?=a)a$", "lookarounds"),
        ("^a{5,2}$", "counts down"),
        ("^a{0,200000}$", "above"),
    ],
)
def test_unreadable_patterns_are_refused(pattern: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_schema({"properties": {"p": {"type": "string", "pattern": pattern}}}, "format")
    assert words in caught.value.message and "#/properties/p/pattern" in caught.value.message
    assert caught.value.param == "format"


def test_pointers_escape_slash_and_tilde() -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_schema({"properties": {"a/b~c": {"pattern": "^(a?){0,1000}$"}}}, "response_format")
    assert "#/properties/a~1b~0c/pattern" in caught.value.message


def test_values_are_not_walked_as_schemas() -> None:
    check_schema({"enum": [{"pattern": "unanchored"}], "const": {"maxLength": 10**9}}, "format")


def test_depth_and_counts_are_bounded() -> None:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}  # 80 levels of JSON
    with pytest.raises(InvalidRequest, match="deeper than 64"):
        check_schema(schema, "format")
    with pytest.raises(InvalidRequest, match="maxItems 100001"):
        check_schema({"type": "array", "maxItems": 100_001}, "format")
    check_schema({"type": "array", "maxItems": 100_000}, "format")
