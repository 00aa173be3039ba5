"""Our reading of a json_schema `pattern` against llama.cpp's own, on patterns made at random (seeded):
every quantifier spelling (`{n}`, `{m,n}`, `{,n}`, `{m,}`, with spaces, empty, three values, negative,
lazy), classes with `]` first or empty, escapes llama.cpp's grammar knows and those it does not, groups
of every kind, nesting, stray brackets and anchors.

llama.cpp's reading is the grammar its converter builds, which llama-server's `/completion` returns
in `generation_settings.grammar`, or its refusal. The two must agree on the outcome (enforced, any
string, refused) and, for an enforced pattern, on the set of repetitions built ((least, most) pairs):
a count one side sees and the other does not (`{,99}` read as text, a class that hides what follows)
is exactly how the guard was bypassed (issue 54). One latitude: where the converter built a grammar
that llama.cpp's grammar parser then refuses (`failed to parse grammar`: a quantifier on a character
of several bytes, on an empty class, on a repetition of nothing), the grammar never runs, so our
reading may call the pattern enforced or refused there."""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserver.engine.schemas import ENFORCED, INVALID, UNENFORCED, read_pattern
from tests.support import Server

SEED = 54
PATTERNS = 2000

READ = [  # what llama.cpp enforces: drawn three times as often as the rest
    "a", "b", "ab", '"', "-", " ", "é", ".", "\\.", "\\*", "\\{", "\\]", "\\\\", "\\n", "\\x41", "[ab]", "[a-z]",
    "[^a]", "[]", "[]a]", "[\\]]", "[a\\-z]",
]  # fmt: skip
ATOMS = READ * 2 + [
    "a", "b", "ab", '"', "-", " ", "é", ".", "\\.", "\\*", "\\{", "\\]", "\\\\", "\\n", "\\t", "\\x41", "\\u00e9",
    "\\d", "\\w", "\\s", "\\b", "\\x4", "[ab]", "[a-z]", "[^a]", "[]", "[]a]", "[\\]]", "[\\d]", "[a\\-z]", "[\\x41]",
    "[", "]", "}", "{", ")", "^", "$", "|",
]  # fmt: skip
QUANTIFIERS = [
    "", "", "", "*", "+", "?", "*?", "+?", "??", "{2}", "{0,2}", "{1,3}", "{,2}", "{2,}", "{ 1,2}", "{1,2 }",
    "{ 0 , 2 }", "{}", "{,}", "{a}", "{1,2,3}", "{-1,2}", "{0}", "{0,0}", "{+1,2}", "{1x,2}", "{1",
]  # fmt: skip
GROUPS = ["(", "(?:", "(?=", "(?P<n>"]


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        if depth < 3 and rng.random() < 0.3:
            inner = random_pattern(rng, depth + 1)
            if rng.random() < 0.3:
                inner += "|" + random_pattern(rng, depth + 1)
            part = rng.choice(GROUPS if rng.random() < 0.3 else ["("]) + inner + (")" if rng.random() < 0.97 else "")
        else:
            part = rng.choice(ATOMS)
        parts.append(part + rng.choice(QUANTIFIERS))
    return "".join(parts)


def anchored(rng: random.Random) -> str:
    body = random_pattern(rng)
    return body if rng.random() < 0.03 else f"^{body}$"


def _grammar_rules(grammar: str) -> dict[str, str]:
    rules: dict[str, str] = {}
    name = ""
    for line in grammar.splitlines():
        found = re.match(r"^([A-Za-z0-9-]+) ::= (.*)$", line)
        if found:
            name = found[1]
            rules[name] = found[2]
        elif name:
            rules[name] += " " + line
    return rules


def _repetitions(body: str) -> set[tuple[int, int | None]]:
    """The repetitions a GBNF rule's body builds: its quantifiers outside literals and classes."""
    found: set[tuple[int, int | None]] = set()
    at = 0
    while at < len(body):
        char = body[at]
        if char in '"[':
            close = '"' if char == '"' else "]"
            at += 1
            while at < len(body) and body[at] != close:
                at += 2 if body[at] == "\\" else 1
            at += 1
            continue
        if char in "*+?":
            found.add({"*": (0, None), "+": (1, None), "?": (0, 1)}[char])
        elif char == "{":
            end = body.index("}", at)
            least, _, most = body[at + 1 : end].partition(",")
            found.add((int(least), int(most) if most else None))
            at = end
        at += 1
    return found


GRAMMAR_REFUSED = "grammar refused"


def llama_reading(
    server: Server, pattern: str, client: httpx.Client | None = None
) -> tuple[str, set[tuple[int, int | None]]]:
    body = {"prompt": "x", "n_predict": 0, "json_schema": {"type": "string", "pattern": pattern}}
    url, headers = server.instance_url + "/completion", server.instance_headers
    if client is None:
        answer = httpx.post(url, json=body, headers=headers, timeout=60)
    else:
        answer = client.post(url, json=body, headers=headers, timeout=60)
    if answer.status_code != 200:
        refused = "failed to parse grammar" in answer.json()["error"]["message"]
        return (GRAMMAR_REFUSED if refused else INVALID), set()
    rules = _grammar_rules(answer.json()["generation_settings"]["grammar"])
    if not rules["root"].startswith('"\\"" ('):
        return UNENFORCED, set()
    found: set[tuple[int, int | None]] = set()
    for name, body in rules.items():
        if name not in ("space", "char"):
            found |= _repetitions(body)
    return ENFORCED, found


def test_the_harness_reads_llama_cpp_grammars(server: Server) -> None:
    """The comparison can fail: known readings come back as llama.cpp builds them."""
    assert llama_reading(server, "^((a{,9}){ 0,9}){0,9 }$") == (ENFORCED, {(0, 9)})
    assert llama_reading(server, "^(?:[]|b)(a{0,2}){1,}$") == (ENFORCED, {(0, 2), (1, None)})
    assert llama_reading(server, "^a+b*c?$") == (ENFORCED, {(1, None), (0, None), (0, 1)})
    assert llama_reading(server, "^\\d{3}$")[0] == UNENFORCED
    assert llama_reading(server, "^a)$")[0] == INVALID
    assert llama_reading(server, "^a|*$")[0] == GRAMMAR_REFUSED


@pytest.mark.slow
def test_our_reading_of_patterns_is_llama_cpps(server: Server) -> None:
    rng = random.Random(SEED)
    patterns = list(dict.fromkeys(anchored(rng) for _ in range(PATTERNS)))
    started = time.monotonic()
    disagreements = []
    outcomes: dict[str, int] = {}
    # One connection pool, four requests at a time (llama-server converts a schema in its HTTP threads):
    # 2,000 patterns in about 20 s here, against 91 s one new client per request.
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        readings = list(pool.map(lambda pattern: llama_reading(server, pattern, client), patterns))
    for pattern, (theirs, repetitions) in zip(patterns, readings, strict=True):
        ours = read_pattern(pattern)
        outcomes[theirs] = outcomes.get(theirs, 0) + 1
        if theirs == GRAMMAR_REFUSED:
            agree = ours.outcome in (ENFORCED, INVALID)
        else:
            agree = ours.outcome == theirs and (theirs != ENFORCED or set(ours.repetitions) == repetitions)
        if not agree:
            disagreements.append((pattern, ours.outcome, sorted(ours.repetitions, key=str), theirs, repetitions))
    print(f"{len(patterns)} patterns in {time.monotonic() - started:.1f} s: {outcomes}")
    assert not disagreements, disagreements[:20]
    assert min(outcomes.get(kind, 0) for kind in (ENFORCED, UNENFORCED, INVALID)) > 50  # every outcome is tried
