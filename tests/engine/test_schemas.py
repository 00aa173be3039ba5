"""The pattern cost model against the measured table in engine/schemas.py, and the schema walk's bounds."""

from __future__ import annotations

import pytest

from llmserver.engine.schemas import PATTERN_COST, Budget, check_schema, pattern_cost
from llmserver.errors import InvalidRequest


@pytest.mark.parametrize(
    ("pattern", "cost"),
    [
        ("^(a{0,100}){0,10}$", 10_000),
        ("^((a{0,7}){0,7}){0,7}$", 16_807),
        ("^(a{0,30}){0,30}$", 27_000),
        # ambiguity over a part that may begin with more than one character weighs ten times (issue 82)
        ("^(a{0,30}b{0,30}){0,30}$", 540_000),
        ("^((a{0,10}){0,10}){0,10}$", 100_000),
        ("^([a-z]{0,50}){0,20}$", 2_000_000),
        ("^(((a|b)?){40})$", 32_000),  # 4.6 s for 8 tokens; ^((a?){40})$ 0.17 s
        ("^((a?){40})$", 1_600),
        ("^(a?){0,1000}$", 1_000_000),
        ("^(a{0,2}){0,500}$", 500_000),
        ("^(?:a{0,2}){0,500}$", 500_000),
        ("^(a{0,2}?){0,500}$", 500_000),
        # A body of one fixed length, or a single repetition, costs nothing however large or deep.
        ("^((a{40}){40}){40}$", 0),
        ("^a{0,100000}$", 0),
        # A body whose length varies splits the same text in as many ways as one that may be empty: the
        # product of the nested counts (issue 82: ^((.{1,40}){1,40}){1,40}$ was priced 0 and held a model).
        ("^(a{1,30}){1,30}$", 27_000),
        ("^((.{1,40}){1,40}){1,40}$", 10_240_000_000),
        ("^((a|aa)+){0,50}$", 30_000),
        ("^(a+)+b$", 10),
        ("^((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)$", 7_650),
        ("^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$", 0),
        ("^[0-9]{3}-[0-9]{4}$", 0),
        # llama.cpp's reading of a count: C's stoi, an empty side is 0 or unbounded (issue 54)
        ("^((a{,7}){,7}){,7}$", 16_807),
        ("^((a{ 0,7}){0,7 }){ 0 , 7}$", 16_807),
        ("^((a{0,7}x?){0,7}){0,7}$", 392 * 49 * 10),
        # a class ends at its first `]`: `[]` is an empty class and what follows is read (issue 54)
        ("^(?:[]|b)((a{0,10}){0,10}){0,10}(?:[]|c)$", 102_200),
    ],
)
def test_pattern_costs(pattern: str, cost: int) -> None:
    assert pattern_cost(pattern) == cost


def test_the_bound_sits_between_the_measured_fast_and_slow_patterns() -> None:
    assert pattern_cost("^(a{0,30}){0,30}$") <= PATTERN_COST < pattern_cost("^(a{0,30}b{0,30}){0,30}$")


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("^(a$", "unbalanced parentheses"),
        ("^a)$", "unbalanced parentheses"),
        ("^[a-$", "unterminated character class"),
        ("^*a$", "nothing to repeat"),
        ("^a|*$", "a quantifier after '|'"),
        ("^(?=a)a$", "cannot enforce (unsupported group syntax"),
        ("^\\d{3}$", "cannot enforce (unsupported escape: \\d)"),
        ("^a{b$", "cannot enforce (unterminated curly brackets)"),
        ("^a{}$", "cannot enforce (invalid number in curly brackets)"),
        ("^a{1,2,3}$", "cannot enforce (wrong number of values"),
        ("^a]$", "cannot enforce (unsupported character: ])"),
        ("^a$b$", "cannot enforce (an anchor inside the pattern)"),
        ("^a{5,2}$", "counts down"),
        ("^a{-1,2}$", "a negative count"),
        ("^a{200000}$", "repeats a part at least 200,000 times"),
        ("^a{2001}$", "llama.cpp's grammar takes at most 2,000"),
        ("^x{5,0}$", "the repetition {5,0} counts down"),  # served as "" before, while {2,1} was refused
        ("^((a|aa)*)*$", "repeats without bound a part that may match nothing"),
        ("^(a?)+$", "repeats without bound a part that may match nothing"),
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


@pytest.mark.parametrize(
    "schema",
    [
        # a property *named* like a keyword is a schema all the same (issue 54)
        {"type": "object", "properties": {"enum": {"type": "string", "pattern": "^((a{0,99}){0,99}){0,99}$"}}},
        {"type": "object", "properties": {"default": {"type": "string", "pattern": "^((a{0,99}){0,99}){0,99}$"}}},
        # values are looked at too: a `$ref` may point into them
        {"$ref": "#/enum/0", "enum": [{"type": "string", "pattern": "^((a{0,99}){0,99}){0,99}$"}]},
        {"examples": [{"pattern": "^((a{0,99}){0,99}){0,99}$"}]},
    ],
)
def test_no_place_in_a_schema_hides_a_pattern(schema: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="too deeply"):
        check_schema(schema, "format")


def test_patterns_share_one_budget() -> None:
    """50 alternatives each within the bound were 55 s for 7 tokens (issue 54): their costs add up."""
    branch = {"type": "string", "pattern": "^(a{0,30}){0,30}$"}  # 27,000 each
    check_schema({"anyOf": [branch]}, "format")
    with pytest.raises(InvalidRequest, match="together cost"):
        check_schema({"anyOf": [branch, branch]}, "format")
    budget = Budget()
    check_schema(branch, "tools", budget=budget)
    with pytest.raises(InvalidRequest, match="together cost"):
        check_schema(branch, "tools", budget=budget)


def test_enums_constants_and_alternatives_are_bounded() -> None:
    check_schema({"enum": list(range(1000))}, "format")
    with pytest.raises(InvalidRequest, match="more than 1000 enum values"):
        check_schema({"enum": list(range(50_000))}, "format")
    with pytest.raises(InvalidRequest, match="more than 65,536 bytes"):
        check_schema({"const": "x" * 70_000}, "format")
    with pytest.raises(InvalidRequest, match="more than 128 alternatives"):
        check_schema({"anyOf": [{"type": "string"}] * 129}, "format")


def test_depth_and_counts_are_bounded() -> None:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}  # 80 levels of JSON
    with pytest.raises(InvalidRequest, match="deeper than 64"):
        check_schema(schema, "format")
    # llama.cpp's grammar refuses a repetition above 2,000 ("failed to parse grammar", naming nothing): ours
    # names the field (issue 82). minItems is written as one item and a repetition of m - 1.
    check_schema({"type": "string", "minLength": 2000}, "format")
    with pytest.raises(InvalidRequest, match="minLength 2001"):
        check_schema({"type": "string", "minLength": 2001}, "format")
    check_schema({"type": "array", "minItems": 2001}, "format")
    with pytest.raises(InvalidRequest, match="minItems 2002"):
        check_schema({"type": "array", "minItems": 2002}, "format")
    # an upper count costs the grammar nothing at any size (maxLength 2**31 - 1: 0.18 s for 8 tokens)
    check_schema({"type": "string", "maxLength": 524_288}, "format")
    check_schema({"type": "array", "maxItems": 2**31 - 1}, "format")
    with pytest.raises(InvalidRequest, match="maxItems 2147483648"):
        check_schema({"type": "array", "maxItems": 2**31}, "format")


def test_a_tools_pattern_llama_cpp_cannot_enforce_is_left_unenforced() -> None:
    """Issue 55: JSON Schema patterns are unanchored by definition; one such tool refused every request."""
    tool = {"type": "object", "properties": {"v": {"type": "string", "pattern": "[0-9]+\\.[0-9]+"}}}
    with pytest.raises(InvalidRequest, match="not anchored"):
        check_schema(tool, "response_format")
    check_schema(tool, "tools.0", budget=Budget(unenforced_ok=True))
    check_schema({"pattern": "^\\d{3}$"}, "tools.0", budget=Budget(unenforced_ok=True))
    with pytest.raises(InvalidRequest, match="cannot be read"):  # what llama.cpp refuses stays refused
        check_schema({"pattern": "^a)$"}, "tools.0", budget=Budget(unenforced_ok=True))
