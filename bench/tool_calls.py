"""How well a model serves tool calls and structured outputs through llmserver: N tries of each,
counted. Against a running server, with the official OpenAI SDK:

    .venv/bin/python -m bench.tool_calls --url http://127.0.0.1:8000 --key KEY [--tries 20]

For each of tool_choice "required" and "auto": how many answers were tool calls, how many of those
had arguments that parse as JSON and name the asked-for city, how many answered directly, and how
many were cut at max_tokens; then how many `parse(response_format=PydanticModel)` calls parsed; then
how often the gateway's own tool-call JSON reached the content (`leaks`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI
from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


def _parses(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


def tool_calls(client: OpenAI, model: str, choice: str, tries: int, max_tokens: int) -> str:
    calls = parsed = paris = direct = cut = 0
    for _ in range(tries):
        answer = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=max_tokens,  # type: ignore[arg-type, list-item]
        ).choices[0]
        if answer.message.tool_calls:
            calls += 1
            arguments = [call.function.arguments for call in answer.message.tool_calls]  # type: ignore[union-attr]
            parsed += all(_parses(a) for a in arguments)
            paris += any("paris" in a.lower() for a in arguments)
        elif answer.finish_reason == "length":
            cut += 1
        else:
            direct += 1
    return (
        f"tool_choice={choice}: {calls}/{tries} tool calls ({parsed} with arguments that parse, {paris} naming "
        f"Paris), {direct} direct answers, {cut} cut at {max_tokens} tokens"
    )


def structured(client: OpenAI, model: str, tries: int, max_tokens: int) -> str:
    ok = 0
    for _ in range(tries):
        try:
            reply = client.chat.completions.parse(
                model=model, messages=[{"role": "user", "content": "Invent a person."}],
                response_format=Person, max_tokens=max_tokens,
            )  # fmt: skip
            ok += reply.choices[0].message.parsed is not None
        except Exception:  # the SDK raises when an answer is cut or does not validate
            pass
    return f"parse(response_format=Person): {ok}/{tries} parsed"


# What the gateway writes into a prompted conversation, and must never come back as an answer's content.
WRAPPERS = ('"tool_calls"', '"tool_result"', '{"response"', "tool_call_id")
AFTER_RESULT = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]  # fmt: skip


def leaks(client: OpenAI, model: str, tries: int) -> list[str]:
    """How often the gateway's own tool-call JSON reaches a client as content: a forced call cut at 60
    tokens, and the answer after a tool result with tool_choice "none" (and with no tools at all)."""
    cases: list[tuple[str, list[Any], dict[str, Any]]] = [
        ("forced call cut at max_tokens=60", ASK, {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 60}),
        ('after a tool result, tool_choice "none"', AFTER_RESULT,
         {"tools": [WEATHER], "tool_choice": "none", "max_tokens": 60}),
        ("after a tool result, no tools", AFTER_RESULT, {"max_tokens": 60}),
    ]  # fmt: skip
    lines = []
    for name, messages, fields in cases:
        leaked = 0
        for _ in range(tries):
            message = client.chat.completions.create(model=model, messages=messages, **fields).choices[0].message
            leaked += any(wrapper in (message.content or "") for wrapper in WRAPPERS)
        lines.append(f"{name}: our JSON in the content {leaked}/{tries} times")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct-Q4_1")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=150)
    args = parser.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.key, max_retries=0)
    for choice in ("required", "auto"):
        print(tool_calls(client, args.model, choice, args.tries, args.max_tokens))
    print(structured(client, args.model, args.tries, args.max_tokens))
    print(*leaks(client, args.model, args.tries), sep="\n")


if __name__ == "__main__":
    main()
