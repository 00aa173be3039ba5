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
bounds of the repetitions around a body that may be empty. A schema's patterns share one budget (the
alternatives of `anyOf`, of a tool list, are all alive at once): above `max_pattern_cost` in all, the
request is refused.

**One reading: llama.cpp's.** A pattern is read exactly as llama.cpp's converter reads it
(`common/json-schema-to-grammar.cpp`, `_pattern_to_rule`, of the pinned build), not as a regex engine
would: every `{` starts a count, read with C's `stoi` (`{,99}`, `{ 0,99}`, `{0,99 }` are repetitions);
a class ends at its first `]` (`[]` is an empty class); only the escapes its grammar knows are read
(`\\d`, `\\w`, `\\s` are not: llama.cpp then accepts any string). `tests/engine/test_schema_reading.py`
compares this reading with the grammar llama-server itself builds, on generated patterns.

The walk is a superset of what llama.cpp reads: every object anywhere in the schema (a property named
`enum` or `pattern`, a value under `enum` or `default` that a `$ref` may point into) is looked at, so
no place can hide a pattern. `enum` and `const` values and the alternatives (`anyOf`, `oneOf`,
`allOf`, a list of types) are bounded in number, since each becomes a branch of the grammar (50,000
enum values held a model for 80 s; measured for 8 tokens: 100 values 0.33 s, 1,000 values 1.25 s,
5,000 values 7.4 s, against 0.24 s without a schema).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from llmserver.errors import InvalidRequest

PATTERN_COST = 30_000  # the largest cost accepted by default (max_pattern_cost; the table above)
PATTERN_CHARS = 4096  # the longest pattern
SCHEMA_DEPTH = 64  # JSON levels in one schema (orjson refuses 255 when it builds llama-server's call)
SCHEMA_COUNT = 100_000  # the largest minLength, minItems, {m,…}, … a schema may state (llama.cpp refuses more)
UPPER_COUNT = 2**31 - 1  # the largest maxLength, maxItems, {…,n} (llama.cpp counts in a C int; cheap at any size)
ENUM_VALUES = 1_000  # `enum` values in all of a request's schemas (as OpenAI's structured outputs)
CONSTANT_BYTES = 64 * 1024  # the JSON of every `enum` and `const` value together
ALTERNATIVES = 128  # anyOf, oneOf and allOf branches and listed types, in all

_COUNTS = {
    "minLength": SCHEMA_COUNT, "minItems": SCHEMA_COUNT, "minProperties": SCHEMA_COUNT,
    "maxLength": UPPER_COUNT, "maxItems": UPPER_COUNT, "maxProperties": UPPER_COUNT,
}  # fmt: skip
_BRANCHES = ("anyOf", "oneOf", "allOf")
_CLASS = 10  # what a character class or `.` adds to the expanded size
_CAP = 2**62  # sizes and products stop growing here (a refusal either way)
_UNBOUNDED = 2  # `*`, `+`, `{m,}` become a rule that refers to itself: counted as two copies
_INT_MAX = 2**31 - 1  # llama.cpp's "no upper bound" in a count


@dataclass
class Budget:
    """What one request's schemas have used so far: they are priced together."""

    most: int = PATTERN_COST
    # Patterns llama.cpp would take as any string (unanchored, `\\d`, …) are accepted, unenforced: in a
    # tool's parameters, where JSON Schema means a search and one such tool must not refuse every request.
    unenforced_ok: bool = False
    label: str = ""  # how messages name the schema, when not by its parameter alone (a tool's name)
    cost: int = 0
    enum_values: int = 0
    constant_bytes: int = 0
    alternatives: int = 0


def check_schema(
    schema: Any, param: str, where: str = "#", depth: int = 0, most: int = PATTERN_COST, budget: Budget | None = None
) -> None:
    """Refuse what llama.cpp would not enforce (a `pattern` it reads as "any string") or could not read,
    and what would make its grammar too costly (see the module's note); `budget`, when given, is shared
    with the request's other schemas. Other schemas it cannot use, llama-server refuses itself."""
    _walk(schema, param, where, depth, budget if budget is not None else Budget(most))


def _walk(schema: Any, param: str, where: str, depth: int, budget: Budget) -> None:
    shown = budget.label or param
    if depth > SCHEMA_DEPTH:
        raise InvalidRequest(f"{shown}: the schema nests deeper than {SCHEMA_DEPTH} levels at {where}", param=param)
    if isinstance(schema, dict):
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            cost = check_pattern(pattern, param, f"{where}/pattern", budget.most, budget.unenforced_ok, shown)
            budget.cost = min(budget.cost + cost, _CAP)
            if budget.cost > budget.most:
                raise InvalidRequest(
                    f"{shown}: the schema's patterns together cost llama.cpp's grammar {budget.cost:,} at {where} "
                    f"(at most {budget.most:,}); make repeated parts non-empty, lower the counts or use fewer",
                    param=param,
                )
        for name, most in _COUNTS.items():
            count = schema.get(name)
            if isinstance(count, int) and not isinstance(count, bool) and count > most:
                raise InvalidRequest(
                    f"{shown}: {name} {count} at {where} is more than this server allows ({most})",
                    param=param,
                )
        _count_constants(schema, param, where, budget)
        for key, value in schema.items():
            _walk(value, param, f"{where}/{_escaped(str(key))}", depth + 1, budget)
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            _walk(value, param, f"{where}/{index}", depth + 1, budget)


def _count_constants(schema: dict[str, Any], param: str, where: str, budget: Budget) -> None:
    shown = budget.label or param
    values = schema.get("enum")
    if isinstance(values, list):
        budget.enum_values += len(values)
        if budget.enum_values > ENUM_VALUES:
            raise InvalidRequest(
                f"{shown}: more than {ENUM_VALUES} enum values in all (at {where}/enum); each is a branch of "
                "llama.cpp's grammar",
                param=param,
            )
    for name in ("enum", "const"):
        if name in schema:
            budget.constant_bytes += len(orjson.dumps(schema[name], option=orjson.OPT_PASSTHROUGH_SUBCLASS))
            if budget.constant_bytes > CONSTANT_BYTES:
                raise InvalidRequest(
                    f"{shown}: the enum and const values come to more than {CONSTANT_BYTES:,} bytes of JSON "
                    f"(at {where}/{name})",
                    param=param,
                )
    branches = sum(len(schema[name]) for name in _BRANCHES if isinstance(schema.get(name), list))
    types = schema.get("type")
    branches += len(types) if isinstance(types, list) else 0
    budget.alternatives += branches
    if budget.alternatives > ALTERNATIVES:
        raise InvalidRequest(
            f"{shown}: more than {ALTERNATIVES} alternatives (anyOf, oneOf, allOf, type lists) in all, at {where}",
            param=param,
        )


def _escaped(key: str) -> str:
    """A key as a JSON pointer writes it (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def check_pattern(
    pattern: str, param: str, where: str, most: int = PATTERN_COST, unenforced_ok: bool = False, label: str = ""
) -> int:
    """The pattern's cost, once it is known that llama.cpp enforces it (or, `unenforced_ok`, takes it as
    any string: cost 0) and that it is within `most`."""
    shown = label or param
    if len(pattern) > PATTERN_CHARS:
        raise InvalidRequest(
            f"{shown}: the pattern at {where} is {len(pattern)} characters long; at most {PATTERN_CHARS}",
            param=param,
        )
    reading = read_pattern(pattern)
    if reading.outcome == UNENFORCED and unenforced_ok:
        return 0
    if reading.outcome == UNENFORCED:
        if not (pattern.startswith("^") and pattern.endswith("$")):
            raise InvalidRequest(
                f"{shown}: the pattern {_short(pattern)} at {where} is not anchored with ^ and $; "
                "llama.cpp can only enforce anchored patterns",
                param=param,
            )
        raise InvalidRequest(
            f"{shown}: the pattern {_short(pattern)} at {where} uses what llama.cpp's grammar cannot enforce "
            f"({reading.reason}): it would accept any string",
            param=param,
        )
    if reading.outcome == INVALID:
        raise InvalidRequest(
            f"{shown}: the pattern {_short(pattern)} at {where} cannot be read: {reading.reason}", param=param
        )
    least = max((pair[0] for pair in reading.repetitions), default=0)
    most_count = max((pair[1] or 0 for pair in reading.repetitions), default=0)
    if least > SCHEMA_COUNT or most_count > UPPER_COUNT:
        raise InvalidRequest(
            f"{shown}: the pattern {_short(pattern)} at {where} repeats a part at least {least:,} times "
            f"(at most {SCHEMA_COUNT:,}) or up to {most_count:,}",
            param=param,
        )
    if reading.cost > most:
        raise InvalidRequest(
            f"{shown}: the pattern {_short(pattern)} at {where} nests repetitions around a part that may be empty "
            f"too deeply for llama.cpp's grammar (cost {reading.cost:,}; at most {most:,}); "
            "make the repeated part non-empty or lower the counts",
            param=param,
        )
    return reading.cost


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def pattern_cost(pattern: str) -> int:
    """The cost of a pattern llama.cpp enforces (the module's note); 0 for one it does not."""
    reading = read_pattern(pattern)
    return reading.cost if reading.outcome == ENFORCED else 0


ENFORCED, UNENFORCED, INVALID = "enforced", "any string", "invalid"


@dataclass
class Reading:
    """How llama.cpp reads a pattern: `enforced` (with its cost and every repetition it builds, as
    (least, most or None) in the order they close), `any string` (it warns and enforces nothing), or
    `invalid` (the request fails)."""

    outcome: str
    cost: int = 0
    reason: str = ""
    repetitions: list[tuple[int, int | None]] = field(default_factory=list)


def read_pattern(pattern: str) -> Reading:
    if len(pattern) < 2 or not pattern.startswith("^") or not pattern.endswith("$"):
        return Reading(UNENFORCED, reason="not anchored with ^ and $")
    reader = _Reader(pattern[1:-1])
    try:
        part = reader.sequence()
        if reader.depth != 0:
            raise _Invalid("unbalanced parentheses")
    except _Unsupported as exc:
        return Reading(UNENFORCED, reason=str(exc))
    except _Invalid as exc:
        return Reading(INVALID, reason=str(exc))
    if reader.problems:
        return Reading(INVALID, reason=reader.problems[0])
    return Reading(ENFORCED, cost=part.cost, repetitions=reader.repetitions)


@dataclass(frozen=True)
class _Part:
    size: int  # grammar positions once repetitions are expanded
    empty: bool  # whether it may match the empty string
    ambiguity: int  # the product of the upper bounds of repetitions around a part that may be empty

    @property
    def cost(self) -> int:
        return self.size * self.ambiguity if self.ambiguity > 1 else 0


_BAR = _Part(0, True, 1)  # an alternation's `|`, while the sequence is read (by identity)
_NOT_LITERAL = frozenset("|.()[]{}*+?^$")
_ESCAPED_CHARACTERS = frozenset("^$.[]()|{}*+?")  # `\.` and the like: the character itself
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_MAX_DEPTH = 100  # llama.cpp's MAX_PATTERN_DEPTH
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


class _Unsupported(Exception):
    """llama.cpp reads the pattern as any string."""


class _Invalid(Exception):
    """llama.cpp refuses the schema."""


def _escape_length(text: str, at: int) -> int:
    """How many characters of `text` from `at` (a backslash) make an escape llama.cpp's grammar knows; 0: none."""
    if at + 1 >= len(text) or text[at] != "\\":
        return 0
    kind = text[at + 1]
    if kind in 'trn\\"[]-':
        return 2
    digits = {"x": 2, "u": 4, "U": 8}.get(kind, 0)
    if not digits or at + 2 + digits > len(text) or not set(text[at + 2 : at + 2 + digits]) <= _HEX_DIGITS:
        return 0
    return 2 + digits


def _stoi(text: str) -> int:
    """C's std::stoi: leading white space, a sign, digits, and whatever follows ignored."""
    found = _STOI.match(text)
    if found is None:
        raise _Unsupported("invalid number in curly brackets")
    value = int(found[1])
    if not -(2**31) <= value <= _INT_MAX:
        raise _Unsupported("invalid number in curly brackets")
    return value


class _Reader:
    """llama.cpp's `_pattern_to_rule`, step for step, building costs instead of grammar rules."""

    def __init__(self, text: str) -> None:
        self.text, self.at, self.depth = text, 0, 0
        self.repetitions: list[tuple[int, int | None]] = []
        self.problems: list[str] = []  # what makes llama.cpp refuse the grammar once it is built

    def sequence(self) -> _Part:
        """From here to the `)` that closes the group (consumed), or to the end."""
        text, seq = self.text, []
        while self.at < len(text):
            char = text[self.at]
            if char == ".":
                seq.append(_Part(_CLASS, False, 1))
                self.at += 1
            elif char == "(":
                self.at += 1
                if self.at < len(text) and text[self.at] == "?":
                    if self.at + 1 < len(text) and text[self.at + 1] == ":":
                        self.at += 2
                    else:
                        raise _Unsupported("unsupported group syntax (lookarounds, named groups, flags)")
                self.depth += 1
                if self.depth > _MAX_DEPTH:
                    raise _Unsupported("pattern nesting too deep")
                seq.append(self.sequence())
            elif char == ")":
                self.at += 1
                if self.depth == 0:
                    raise _Invalid("unbalanced parentheses")
                self.depth -= 1
                return _joined(seq)
            elif char in "^$":
                raise _Unsupported("an anchor inside the pattern")
            elif char == "[":
                self.at += 1
                while self.at < len(text) and text[self.at] != "]":
                    if text[self.at] == "\\":
                        length = _escape_length(text, self.at)
                        if length == 0:
                            raise _Unsupported(
                                f"unsupported escape in a character class: {text[self.at : self.at + 2]}"
                            )
                        self.at += length
                    else:
                        self.at += 1
                if self.at >= len(text):
                    raise _Invalid("unterminated character class")
                self.at += 1
                seq.append(_Part(_CLASS, False, 1))
            elif char == "|":
                seq.append(_BAR)
                self.at += 1
            elif char in "*+?":
                if not seq:
                    raise _Invalid("nothing to repeat")
                seq[-1] = self._repeated(seq[-1], *{"*": (0, None), "+": (1, None), "?": (0, 1)}[char])
                self.at += 1
            elif char == "{":
                end = text.find("}", self.at + 1)
                if end < 0:
                    raise _Unsupported("unterminated curly brackets")
                numbers = text[self.at + 1 : end].split(",")
                self.at = end + 1
                if len(numbers) == 1:
                    least = _stoi(numbers[0])
                    most: int | None = least
                elif len(numbers) == 2:
                    least = _stoi(numbers[0]) if numbers[0] else 0
                    most = _stoi(numbers[1]) if numbers[1] else None
                else:
                    raise _Unsupported("wrong number of values in curly brackets")
                if not seq:
                    raise _Invalid("nothing to repeat")
                # llama.cpp writes these into the grammar, whose parser then refuses it, or (a count that
                # goes down) loops without end: refused unless something later makes it "any string".
                if most == 0:
                    pass  # nothing is written for it, whatever the lower count says
                elif least < 0 or (most is not None and most < 0):
                    self.problems.append("a negative count")
                elif most is not None and most < least:
                    self.problems.append(f"the repetition {{{least},{most}}} counts down")
                seq[-1] = self._repeated(seq[-1], max(least, 0), most if most is None or most >= 0 else 0)
            else:
                seq.append(self._literal())
        return _joined(seq)

    def _literal(self) -> _Part:
        """Characters up to the one a quantifier may follow (which is a literal of its own)."""
        text, length, size = self.text, len(self.text), 0
        while self.at < length:
            char = text[self.at]
            if char == "\\":
                if self.at == length - 1:
                    raise _Invalid("trailing backslash")
                if text[self.at + 1] in _ESCAPED_CHARACTERS:
                    self.at += 2
                else:
                    escape = _escape_length(text, self.at)
                    if escape == 0:
                        raise _Unsupported(f"unsupported escape: {text[self.at : self.at + 2]}")
                    self.at += escape
                size += 1
            elif char == '"' or (  # a quote is taken whatever follows, as llama.cpp does
                char not in _NOT_LITERAL
                and (
                    self.at == length - 1
                    or size == 0
                    or text[self.at + 1] == "."
                    or text[self.at + 1] not in _NOT_LITERAL
                )
            ):
                self.at += 1
                size += 1
            else:
                break
        if size == 0:
            raise _Unsupported(f"unsupported character: {text[self.at]}")  # a stray `]` or `}`
        return _Part(size, False, 1)

    def _repeated(self, part: _Part, least: int, most: int | None) -> _Part:
        if part is _BAR:
            self.problems.append("a quantifier after '|'")  # llama.cpp builds a grammar its parser refuses
            return part
        if most == _INT_MAX:
            most = None
        if most == 0:
            return _Part(0, True, 1)
        self.repetitions.append((least, most))
        copies = most if most is not None else max(least, 1) + _UNBOUNDED - 1
        ambiguity = part.ambiguity * copies if part.empty and copies > 1 else part.ambiguity
        return _Part(min(part.size * max(copies, 1), _CAP), least == 0 or part.empty, min(ambiguity, _CAP))


def _joined(seq: list[_Part]) -> _Part:
    """A sequence with its `|`s: the alternation of its branches."""
    branches: list[_Part] = []
    size, empty, ambiguity = 0, True, 1
    for part in seq:
        if part is _BAR:
            branches.append(_Part(size, empty, ambiguity))
            size, empty, ambiguity = 0, True, 1
        else:
            size, empty, ambiguity = min(size + part.size, _CAP), empty and part.empty, max(ambiguity, part.ambiguity)
    branches.append(_Part(size, empty, ambiguity))
    return _Part(
        min(sum(b.size for b in branches), _CAP), any(b.empty for b in branches), max(b.ambiguity for b in branches)
    )
