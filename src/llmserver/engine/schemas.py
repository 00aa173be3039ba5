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

One large repetition stays cheap (`^a{0,100000}$`: 0.3 s), and so does a body of one fixed length however
it nests (`^((a{40}){40}){40}$`: 0.3 s for 32 tokens). The cost: the pattern's expanded size (a character 1,
a class 10, a repetition its body times its upper bound) times the product of the upper bounds of the
repetitions around a body whose length varies — one that may be empty, or match shorter and longer texts
(issue 82: `^((.{1,40}){1,40}){1,40}$`, priced 0 when only empty bodies counted, held a model for over 15 s
with a prompt whose preferred tokens it refuses, as every pattern below is now measured) — and ten times
that when such a body may begin with more than one character (`^((a?){40})$` 0.17 s for 8 tokens,
`^(((a|b)?){40})$` 4.6 s, `^(([a-z]?){40})$` no answer in 10 s: every candidate token is checked against
every parse the nesting keeps alive). A repetition without bound of a body that may match nothing
(`^((a|aa)*)*$`) and a count that goes down (`{5,0}`, which llama.cpp serves as nothing while it refuses
`{2,1}`) are refused. `bench/grammar_family.py` times the quantifier x atom x nesting family on
llama-server. A schema's patterns share one budget (the alternatives of `anyOf`, of a tool list, are all
alive at once): above `max_pattern_cost` in all, the request is refused.

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
# llama.cpp's grammar parser refuses a repetition whose lower count is above its MAX_REPETITION_THRESHOLD
# (2,000: "failed to parse grammar", a 400 that names nothing): minLength and a pattern's {m,…} are written as
# such a repetition, minItems as one of m - 1 (after the first item).
REPETITION_THRESHOLD = 2000
SCHEMA_COUNT = 100_000  # the largest minProperties a schema may state
UPPER_COUNT = 2**31 - 1  # the largest maxLength, maxItems, {…,n} (llama.cpp counts in a C int; cheap at any size)
ENUM_VALUES = 1_000  # `enum` values in all of a request's schemas (as OpenAI's structured outputs)
CONSTANT_BYTES = 64 * 1024  # the JSON of every `enum` and `const` value together
ALTERNATIVES = 128  # anyOf, oneOf and allOf branches and listed types, in all

_COUNTS = {
    "minLength": REPETITION_THRESHOLD, "minItems": REPETITION_THRESHOLD + 1, "minProperties": SCHEMA_COUNT,
    "maxLength": UPPER_COUNT, "maxItems": UPPER_COUNT, "maxProperties": UPPER_COUNT,
}  # fmt: skip
_BRANCHES = ("anyOf", "oneOf", "allOf")
_CLASS = 10  # what a character class or `.` adds to the expanded size
# What ambiguity over a part that may begin with more than one character costs more: measured, `^((a?){40})$`
# 0.17 s for 8 tokens against 4.6 s for `^(((a|b)?){40})$` and no answer in 10 s for `^(([a-z]?){40})$` (every
# candidate token the model prefers is then checked against every parse the nesting keeps alive).
_WIDE = 10
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
    if reading.refusal:
        raise InvalidRequest(f"{shown}: the pattern {_short(pattern)} at {where}: {reading.refusal}", param=param)
    least = max((pair[0] for pair in reading.repetitions), default=0)
    most_count = max((pair[1] or 0 for pair in reading.repetitions), default=0)
    if least > REPETITION_THRESHOLD or most_count > UPPER_COUNT:
        raise InvalidRequest(
            f"{shown}: the pattern {_short(pattern)} at {where} repeats a part at least {least:,} times "
            f"(llama.cpp's grammar takes at most {REPETITION_THRESHOLD:,}) or up to {most_count:,}",
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
    refusal: str = ""  # why this server refuses a pattern llama.cpp would take (it could not answer in time)


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
    refusal = reader.refusals[0] if reader.refusals else ""
    return Reading(ENFORCED, cost=part.cost, repetitions=reader.repetitions, refusal=refusal)


@dataclass(frozen=True)
class _Part:
    size: int  # grammar positions once repetitions are expanded
    empty: bool  # whether it may match the empty string
    # The product of the upper bounds of the repetitions around a part whose length varies (empty, or shorter
    # and longer matches): each splits the same text into copies in that many more ways, and llama.cpp keeps
    # every split alive. A part of one fixed length repeated splits one way however it nests.
    ambiguity: int
    length: int | None = 0  # the one length it matches; None: it may match more than one
    first: frozenset[str] | None = frozenset()  # the characters it may begin with; None: a class, `.`, many
    wide: bool = False  # some of its ambiguity is over a part that may begin with more than one character

    @property
    def cost(self) -> int:
        if self.ambiguity <= 1:
            return 0
        return min(self.size * self.ambiguity * (_WIDE if self.wide else 1), _CAP)


_BAR = _Part(0, True, 1)  # an alternation's `|`, while the sequence is read (by identity)
_ANY = _Part(_CLASS, False, 1, 1, None)  # a character class or `.`
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
        self.refusals: list[str] = []  # what llama.cpp would take but could not answer in a bounded time

    def sequence(self) -> _Part:
        """From here to the `)` that closes the group (consumed), or to the end."""
        text, seq = self.text, []
        while self.at < len(text):
            char = text[self.at]
            if char == ".":
                seq.append(_ANY)
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
                seq.append(_ANY)
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
                    if least > 0:  # llama.cpp writes nothing for it; any regex engine refuses it
                        self.refusals.append(f"the repetition {{{least},0}} counts down")
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
        begins = text[self.at : self.at + 2] if text[self.at] == "\\" else text[self.at]
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
        return _Part(size, False, 1, size, frozenset({begins}))

    def _repeated(self, part: _Part, least: int, most: int | None) -> _Part:
        if part is _BAR:
            self.problems.append("a quantifier after '|'")  # llama.cpp builds a grammar its parser refuses
            return part
        if most == _INT_MAX:
            most = None
        if most == 0:
            return _Part(0, True, 1)
        self.repetitions.append((least, most))
        if most is None and part.empty:
            # Without bound around what may match nothing (`(a*)*`): the same text splits in endless ways.
            self.refusals.append("it repeats without bound a part that may match nothing (write the inner part once)")
        copies = most if most is not None else max(least, 1) + _UNBOUNDED - 1
        varies = part.empty or part.length is None
        ambiguity, wide = part.ambiguity, part.wide
        if varies and copies > 1:
            ambiguity *= copies
            wide = wide or part.first is None or len(part.first) > 1
        length = part.length * least if part.length is not None and most == least else None
        return _Part(
            min(part.size * max(copies, 1), _CAP), least == 0 or part.empty, min(ambiguity, _CAP), length,
            part.first, wide,
        )  # fmt: skip


def _joined(seq: list[_Part]) -> _Part:
    """A sequence with its `|`s: the alternation of its branches."""
    branches: list[_Part] = []
    branch = _Part(0, True, 1)
    for part in seq:
        if part is _BAR:
            branches.append(branch)
            branch = _Part(0, True, 1)
        else:
            branch = _then(branch, part)
    branches.append(branch)
    if len(branches) == 1:
        return branches[0]
    lengths = {b.length for b in branches}
    firsts = [b.first for b in branches]
    return _Part(
        min(sum(b.size for b in branches), _CAP),
        any(b.empty for b in branches),
        max(b.ambiguity for b in branches),
        lengths.pop() if len(lengths) == 1 else None,
        None if None in firsts else frozenset().union(*(f for f in firsts if f is not None)),
        any(b.wide for b in branches),
    )


def _then(before: _Part, part: _Part) -> _Part:
    """`before` followed by `part`."""
    length = before.length + part.length if before.length is not None and part.length is not None else None
    if not before.empty:
        first = before.first
    elif before.first is None or part.first is None:
        first = None
    else:
        first = before.first | part.first  # what may be empty lets what follows begin the text
    return _Part(
        min(before.size + part.size, _CAP), before.empty and part.empty, max(before.ambiguity, part.ambiguity),
        length, first, before.wide or part.wide,
    )  # fmt: skip
