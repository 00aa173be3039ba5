"""What a JSON schema may ask of llama.cpp's grammar: the checks run on `response_format`, the native
`format` and tool parameters before admission, each refusal a 400 naming the JSON pointer.

llama-server turns a schema into a grammar and checks every candidate token against each of the
grammar's live parse stacks. A `pattern` whose repetitions nest around a body that may match nothing
(`^((a{0,99}){0,99}){0,99}$`) multiplies those stacks: one such request held an instance's main
thread for over eleven minutes while its /health kept answering. Measured on this build (SmolLM2-135M,
2 cores), as seconds for a few tokens and as the cost below:

| pattern | cost | time |
|---|---|---|
| `^(a{0,100}){0,10}$` | 10,000 | 0.15 s |
| `^((a{0,7}){0,7}){0,7}$` | 16,807 | 0.9 s (42 ms a token) |
| `^(a{0,30}){0,30}$` | 27,000 | 0.46 s (20 ms a token) |
| `^(a{0,30}b{0,30}){0,30}$` | 54,000 | 5.8 s |
| `^((a{0,10}){0,10}){0,10}$` | 100,000 | 11 s |
| `^([a-z]{0,50}){0,20}$` | 200,000 | 8.3 s |
| `^(a?){0,1000}$`, `^(a{0,2}){0,500}$` | 10⁶, 5·10⁵ | over 20 s, no end seen |

A repetition whose body cannot be empty stays cheap however it nests (`^(a{1,30}){1,30}$`: 0.23 s), and
so does one large repetition (`^a{0,100000}$`: 0.3 s). The cost: the pattern's expanded size (a
character 1, a class 10, a repetition its body times its upper bound) times the product of the upper
bounds of the repetitions around a body that may be empty. Above `PATTERN_COST` it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmserver.errors import InvalidRequest

PATTERN_COST = 30_000  # the largest cost accepted by default (max_pattern_cost; the table above)
PATTERN_CHARS = 4096  # the longest pattern
SCHEMA_DEPTH = 64  # JSON levels in one schema (orjson refuses 255 when it builds llama-server's call)
SCHEMA_COUNT = 100_000  # the largest minLength, maxItems, {m,n}, … a schema may state

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_DATA_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: not walked
_CLASS = 10  # what a character class, `.` or `\d` adds to the expanded size
_CAP = 2**62  # sizes and products stop growing here (a refusal either way)
_UNBOUNDED = 2  # `*`, `+`, `{m,}` become a rule that refers to itself: counted as two copies


def check_schema(schema: Any, param: str, where: str = "#", depth: int = 0, most: int = PATTERN_COST) -> None:
    """Refuse what llama.cpp would not enforce (a `pattern` not anchored with ^ and $: it then accepts
    any string) and what would make its grammar too costly (see the module's note); other schemas it
    cannot use, llama-server refuses itself, naming the place."""
    if depth > SCHEMA_DEPTH:
        raise InvalidRequest(f"{param}: the schema nests deeper than {SCHEMA_DEPTH} levels at {where}", param=param)
    if isinstance(schema, dict):
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            check_pattern(pattern, param, f"{where}/pattern", most)
        for name in _COUNTS:
            count = schema.get(name)
            if isinstance(count, int) and not isinstance(count, bool) and count > SCHEMA_COUNT:
                raise InvalidRequest(
                    f"{param}: {name} {count} at {where} is more than this server allows ({SCHEMA_COUNT})",
                    param=param,
                )
        for key, value in schema.items():
            if key not in _DATA_KEYS:
                check_schema(value, param, f"{where}/{_escaped(str(key))}", depth + 1, most)
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            check_schema(value, param, f"{where}/{index}", depth + 1, most)


def _escaped(key: str) -> str:
    """A key as a JSON pointer writes it (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def check_pattern(pattern: str, param: str, where: str, most: int = PATTERN_COST) -> None:
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise InvalidRequest(
            f"{param}: the pattern {pattern!r} at {where} is not anchored with ^ and $; "
            "llama.cpp can only enforce anchored patterns",
            param=param,
        )
    if len(pattern) > PATTERN_CHARS:
        raise InvalidRequest(
            f"{param}: the pattern at {where} is {len(pattern)} characters long; at most {PATTERN_CHARS}",
            param=param,
        )
    try:
        cost = pattern_cost(pattern)
    except _Unreadable as exc:
        raise InvalidRequest(
            f"{param}: the pattern {_short(pattern)} at {where} cannot be read: {exc}", param=param
        ) from None
    if cost > most:
        raise InvalidRequest(
            f"{param}: the pattern {_short(pattern)} at {where} nests repetitions around a part that may be empty "
            f"too deeply for llama.cpp's grammar (cost {cost:,}; at most {most:,}); "
            "make the repeated part non-empty or lower the counts",
            param=param,
        )


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


@dataclass(frozen=True)
class _Part:
    size: int  # grammar positions once repetitions are expanded
    empty: bool  # whether it may match the empty string
    ambiguity: int  # the product of the upper bounds of repetitions around a part that may be empty

    @property
    def cost(self) -> int:
        return self.size * self.ambiguity if self.ambiguity > 1 else 0


class _Unreadable(Exception):
    pass


def pattern_cost(pattern: str) -> int:
    """The cost of an anchored pattern (the module's note), read as llama.cpp reads patterns: literals,
    escapes, classes, `.`, groups (`(…)`, `(?:…)`), `|`, and `*`, `+`, `?`, `{n}`, `{n,}`, `{m,n}`."""
    reader = _Reader(pattern[1:-1])
    part = reader.alternation()
    if reader.at < len(reader.text):
        raise _Unreadable(f"unbalanced ')' at character {reader.at + 1}")
    return part.cost


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def alternation(self) -> _Part:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.sequence())
        size = min(sum(b.size for b in branches), _CAP)
        return _Part(size, any(b.empty for b in branches), max(b.ambiguity for b in branches))

    def sequence(self) -> _Part:
        size, empty, ambiguity = 0, True, 1
        while self.peek() not in ("", "|", ")"):
            part = self.repeated(self.atom())
            size, empty, ambiguity = min(size + part.size, _CAP), empty and part.empty, max(ambiguity, part.ambiguity)
        return _Part(size, empty, ambiguity)

    def atom(self) -> _Part:
        char = self.peek()
        self.at += 1
        if char == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.peek() == "?":
                raise _Unreadable("lookarounds and named groups are not supported by llama.cpp")
            inner = self.alternation()
            if self.peek() != ")":
                raise _Unreadable("a group is not closed")
            self.at += 1
            return inner
        if char == "[":
            self._class()
            return _Part(_CLASS, False, 1)
        if char == "\\":
            if self.at >= len(self.text):
                raise _Unreadable("the pattern ends with a backslash")
            escaped = self.text[self.at]
            self.at += 1
            return _Part(_CLASS if escaped in "dDwWsS" else 1, False, 1)
        if char == ".":
            return _Part(_CLASS, False, 1)
        if char in "*+?":
            raise _Unreadable(f"{char!r} at character {self.at} repeats nothing")
        return _Part(1, False, 1)

    def _class(self) -> None:
        if self.peek() == "^":
            self.at += 1
        if self.peek() == "]":
            self.at += 1
        while self.peek() not in ("", "]"):
            self.at += 2 if self.peek() == "\\" else 1
        if self.peek() != "]":
            raise _Unreadable("a character class is not closed")
        self.at += 1

    def repeated(self, part: _Part) -> _Part:
        while True:
            bounds = self._quantifier()
            if bounds is None:
                return part
            least, most = bounds
            if least > SCHEMA_COUNT or (most or 0) > SCHEMA_COUNT:
                raise _Unreadable(f"a repetition count above {SCHEMA_COUNT}")
            copies = most if most is not None else max(least, 1) + _UNBOUNDED - 1
            ambiguity = part.ambiguity * copies if part.empty and copies > 1 else part.ambiguity
            part = _Part(min(part.size * max(copies, 1), _CAP), least == 0 or part.empty, min(ambiguity, _CAP))

    def _quantifier(self) -> tuple[int, int | None] | None:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.at += 1
            if self.peek() in ("?", "+"):  # lazy or possessive: the same language
                self.at += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        if char != "{":
            return None
        end = self.text.find("}", self.at)
        inside = self.text[self.at + 1 : end] if end > 0 else ""
        low, comma, high = inside.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            return None  # a literal `{`, as llama.cpp reads one that starts no count
        self.at = end + 1
        least = int(low)
        most = int(high) if high else (None if comma else least)
        if most is not None and most < least:
            raise _Unreadable(f"the repetition {{{inside}}} counts down")
        return least, most
