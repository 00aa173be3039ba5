"""The APIs today's clients speak, against the real server with their own SDKs: OpenAI's Responses
(the OpenAI SDK, the OpenAI Agents SDK on its default path), Anthropic's Messages (Anthropic's SDK),
structured outputs through pydantic-ai and instructor, and reasoning with a chat template that thinks.

These are protocol checks, not answer quality: where the embedded 135M model cannot finish an agent
loop by itself, the turn is scripted (a tool forced on the first turn, then no tools)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmserver.models.files import embedded_model_path
from tests.support import COUNTING, MODEL, Server, assert_error, make_key_record, started, store_rows, wait_for
from tests.support.structured import Person

THINK = "smol-think"
TEMPLATE = Path(__file__).parent.parent / "templates" / "chatml_think.jinja"
CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = 1

[[models]]
name = "{THINK}"
path = "{embedded_model_path()}"
chat_template_file = "{TEMPLATE}"
parallel = 1
ctx_size = 1024
threads = 1
"""
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": WEATHER["parameters"],
}
WRAPPERS = ('"tool_calls"', '"tool_result"', '{"response"')
LONG_QUESTION = "Explain in detail why the sky is blue."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with started(tmp_path_factory.mktemp("client-apis"), CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def keyed(server: Server) -> tuple[str, str]:
    return make_key_record(server.data_dir, "clients", quota_tokens=10_000_000, quota_period="month")


@pytest.fixture(scope="module")
def key(keyed: tuple[str, str]) -> str:
    return keyed[1]


@pytest.fixture(scope="module")
def sdk(server: Server, key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server: Server, key: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120) as client:
        yield client


def post(server: Server, key: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}", **headers}, timeout=120)


def ledger_rows(server: Server, key_id: str, endpoint: str) -> list[dict[str, Any]]:
    return store_rows(
        server.data_dir, "SELECT * FROM usage_ledger WHERE key_id = ? AND endpoint = ? ORDER BY id", key_id, endpoint
    )


# OpenAI's Responses API


def test_a_response_with_usage_in_the_ledger(server: Server, sdk: openai.OpenAI, keyed: tuple[str, str]) -> None:
    before = len(ledger_rows(server, keyed[0], "/v1/responses"))
    response = sdk.responses.create(model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=8)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text and response.usage is not None and response.usage.output_tokens > 0
    assert wait_for(lambda: len(ledger_rows(server, keyed[0], "/v1/responses")) == before + 1, 5)
    row = ledger_rows(server, keyed[0], "/v1/responses")[-1]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )


def test_a_streamed_response_assembles_in_the_sdk(sdk: openai.OpenAI) -> None:
    # Greedy, and room enough to end by itself: the SDK's helper takes only a completed response.
    with sdk.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=300, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.status == "completed" and final.output_text
    # Cut by max_output_tokens, a stream ends as OpenAI's does: response.incomplete.
    events = list(
        sdk.responses.create(model=MODEL, input=LONG_QUESTION, max_output_tokens=6, temperature=0, stream=True)
    )
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details is not None
    assert last.response.output_text == deltas and last.response.usage is not None
    assert last.response.usage.output_tokens == 6


def test_a_function_call_round_trip_leaks_no_json(sdk: openai.OpenAI) -> None:
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.responses.create(
        model=MODEL,
        input=asked,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,  # type: ignore[arg-type, list-item]
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)
    turn = [*asked, *(call.model_dump(exclude_none=True) for call in calls)]
    turn += [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"} for call in calls]
    second = sdk.responses.create(
        model=MODEL,
        input=turn,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,  # type: ignore[arg-type]
    )
    assert second.output_text and not any(wrapper in second.output_text for wrapper in WRAPPERS)


def test_input_tokens_are_what_the_response_reads(server: Server, key: str, sdk: openai.OpenAI) -> None:
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Name a colour.", "tools": [WEATHER]}
    counted = post(server, key, "/v1/responses/input_tokens", body)
    assert counted.status_code == 200 and counted.json()["object"] == "response.input_tokens"
    response = sdk.responses.create(**body, max_output_tokens=2)  # type: ignore[arg-type]
    assert response.usage is not None and counted.json()["input_tokens"] == response.usage.input_tokens


def test_structured_output_through_text_format(sdk: openai.OpenAI) -> None:
    parsed = sdk.responses.parse(
        model=MODEL, input="Invent a person.", text_format=Person, max_output_tokens=100, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person)


def test_a_file_part_is_read(sdk: openai.OpenAI) -> None:
    note = base64.b64encode(b"The meeting moved to Thursday at 10.").decode()
    part = {"type": "input_file", "filename": "note.txt", "file_data": f"data:text/plain;base64,{note}"}
    with_file = sdk.responses.create(
        model=MODEL, max_output_tokens=4,
        input=[{"role": "user", "content": [part, {"type": "input_text", "text": "When is the meeting?"}]}],  # type: ignore[list-item]
    )  # fmt: skip
    without = sdk.responses.create(model=MODEL, input="When is the meeting?", max_output_tokens=4)
    assert with_file.usage is not None and without.usage is not None
    assert with_file.usage.input_tokens > without.usage.input_tokens + 8


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": "x", "mood": "happy"}]}, "input.0.mood"),
        ({"temperatur": 1}, "temperatur"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ],
)
def test_each_refused_responses_field_is_400_naming_it(
    server: Server, key: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    assert_error(post(server, key, "/v1/responses", body), 400, "invalid_request_error", param)


def test_the_openai_agents_sdk_runs_on_responses_and_on_chat(server: Server, key: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # it would send its traces to OpenAI
    called: list[str] = []

    # Scripted: the tool is required on the first turn, one call at a time, and gone once called, so
    # that the next turn answers in words (the embedded model would call it again and again).
    @function_tool(is_enabled=lambda context, agent: not called)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"18 C and sunny in {city}"

    async def run(model: Any) -> Any:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            agent = Agent(
                name="weather", instructions="Answer briefly.", tools=[get_weather], model=model(MODEL, client),
                # One call at a time (with parallel calls allowed, the embedded model repeats its call until
                # max_tokens cuts it), greedy and with room to end: the SDK takes an incomplete response
                # (cut by max_tokens) for an error.
                model_settings=ModelSettings(
                    tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=0
                ),
            )  # fmt: skip
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    for model in (OpenAIResponsesModel, OpenAIChatCompletionsModel):
        called.clear()
        result = asyncio.run(run(model))
        kinds = [type(item).__name__ for item in result.new_items]  # the model may call it twice at once
        calls = kinds.count("ToolCallItem")
        assert calls >= 1 and kinds.count("ToolCallOutputItem") == calls, (model, kinds)
        assert kinds[-1] == "MessageOutputItem" and len(kinds) == 2 * calls + 1, (model, kinds)
        assert called and isinstance(result.final_output, str) and result.final_output
        assert not any(wrapper in result.final_output for wrapper in WRAPPERS)


def test_pydantic_ai_structured_output_on_chat_and_responses(server: Server, key: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def run(model: Any) -> Any:
        # Not run_sync: it leaves an event loop of its own open (a ResourceWarning).
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            provider = OpenAIProvider(openai_client=client)
            # One output call, greedy: with parallel calls allowed the embedded model repeats its call until
            # max_tokens cuts it, which pydantic-ai takes for an error.
            settings: Any = {"max_tokens": 200, "temperature": 0, "parallel_tool_calls": False}
            agent = Agent(model(MODEL, provider=provider), output_type=Person, model_settings=settings)
            return (await agent.run("Invent a person.")).output

    for model in (OpenAIChatModel, OpenAIResponsesModel):
        assert isinstance(asyncio.run(run(model)), Person)


@pytest.mark.slow
def test_instructor_structured_output(server: Server, key: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """instructor pins an older jiter than the OpenAI SDK of this suite needs: it runs from a folder of
    its own, installed from PyPI with its own dependencies, as its users get it."""
    target = tmp_path_factory.mktemp("instructor")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(target),
         "instructor"],
        check=True, timeout=600,
    )  # fmt: skip
    script = textwrap.dedent(f"""
        import instructor, openai, pydantic
        class Person(pydantic.BaseModel):
            name: str
            age: int
        client = instructor.from_openai(openai.OpenAI(base_url="{server.url}/v1", api_key="{key}", max_retries=0))
        for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
            person = instructor.patch(client.client, mode=mode).chat.completions.create(
                model="{MODEL}", response_model=Person, max_tokens=100, max_retries=2, temperature=0,
                messages=[{{"role": "user", "content": "Invent a person."}}])
            print(mode.value, type(person).__name__)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], env={"PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["tool_call", "Person", "json_schema_mode", "Person"], result.stdout


# Anthropic's Messages API


def test_a_message_with_usage_in_the_ledger(
    server: Server, claude: anthropic.Anthropic, keyed: tuple[str, str]
) -> None:
    before = len(ledger_rows(server, keyed[0], "/v1/messages"))
    message = claude.messages.create(
        model=MODEL, max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert message.type == "message" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.content[0].type == "text" and message.content[0].text
    assert wait_for(lambda: len(ledger_rows(server, keyed[0], "/v1/messages")) == before + 1, 5)
    row = ledger_rows(server, keyed[0], "/v1/messages")[-1]
    counted = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (counted, message.usage.output_tokens)


def test_a_streamed_message_assembles_in_the_sdk(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": LONG_QUESTION}], extra_body={"temperature": 0}
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.content[0].type == "text" and final.content[0].text


def test_a_stop_sequence_is_named_and_message_start_counts_the_prompt(claude: anthropic.Anthropic) -> None:
    """Issue 55: `stop_reason` was `end_turn` where a stop sequence ended the answer, and `message_start`
    said `input_tokens: 0`."""
    asked: Any = {
        "model": MODEL, "max_tokens": 40, "stop_sequences": ["7", "never"], "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Continue the list: " + COUNTING[:14]}],
    }  # fmt: skip
    message = claude.messages.create(**asked)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "7"), message
    with claude.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(event for event in events if event.type == "message_start")
    assert start.message.usage.input_tokens + (start.message.usage.cache_read_input_tokens or 0) > 10
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "7")
    unstopped = claude.messages.create(**{**asked, "stop_sequences": ["never"], "max_tokens": 3})
    assert (unstopped.stop_reason, unstopped.stop_sequence) == ("max_tokens", None)


def test_tool_use_and_its_result(claude: anthropic.Anthropic) -> None:
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "any"},
        messages=asked,  # type: ignore[list-item]
    )
    uses = [block for block in first.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    assert first.stop_reason in ("tool_use", "max_tokens")
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"} for use in uses]
    turn = [*asked, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    second = claude.messages.create(model=MODEL, max_tokens=40, tools=[ANTHROPIC_WEATHER], tool_choice={"type": "none"},
                                    extra_body={"temperature": 0},
                                    messages=turn)  # type: ignore[list-item]  # fmt: skip
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text and not any(wrapper in text for wrapper in WRAPPERS)


def test_structured_output_through_output_config(claude: anthropic.Anthropic) -> None:
    schema = Person.model_json_schema()
    message = claude.messages.create(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert message.content[0].type == "text"
    Person.model_validate_json(message.content[0].text)


def test_a_document_block_is_read_and_tokens_are_counted(claude: anthropic.Anthropic) -> None:
    source = {"type": "text", "media_type": "text/plain", "data": "The meeting moved to Thursday at 10."}
    document = {"type": "document", "title": "note.txt", "source": source}
    asked: Any = [{"role": "user", "content": [document, {"type": "text", "text": "When is the meeting?"}]}]
    counted = claude.messages.count_tokens(model=MODEL, messages=asked).input_tokens
    plain = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "When is the meeting?"}])
    assert counted > plain.input_tokens + 8
    message = claude.messages.create(model=MODEL, max_tokens=2, messages=asked)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted


def test_an_image_in_a_tool_result_is_refused_clearly_by_a_model_that_cannot_see(server: Server, key: str) -> None:
    from tests.support.images import png

    data = base64.b64encode(png(8, 8)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Look at a.png."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]}  # fmt: skip
    answered = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60)
    assert answered.status_code == 400, answered.text
    error = answered.json()["error"]
    assert error["type"] == "invalid_request_error" and "messages.2" in error["message"], error


def test_anthropic_errors_and_its_key_header(server: Server, key: str) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-a-key", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API key"},
    }
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    answered = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60)
    assert answered.status_code == 200 and answered.json()["type"] == "message"
    assert answered.headers["x-llmserver-instance"]  # issue 55: it was read before the slot, and empty
    # What Claude Code sends by default (issue 55: each was a 400): answered
    claude_code = {
        **body, "max_tokens": 32000, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
        "messages": [{"role": "system", "content": "Agents: none."}, {"role": "user", "content": []},
                     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Say a."},
                     {"role": "system", "content": "A task finished."}],
        "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {
            "file_path": {"type": "string", "maxLength": 524288}}}, "strict": True, "eager_input_streaming": True}],
    }  # fmt: skip
    accepted = httpx.post(server.url + "/v1/messages", json=claude_code, headers={"x-api-key": key}, timeout=120)
    assert accepted.status_code == 200, accepted.text
    streamed = httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, "stream": True,
                          "client_metadata": {"originator": "codex_exec"}}, headers={"Authorization": f"Bearer {key}"},
                          timeout=60)  # fmt: skip
    assert streamed.status_code == 200 and streamed.headers["x-llmserver-instance"]
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"model": "nope"}, "not_found_error"),
        ({"max_tokens": 0}, "invalid_request_error"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "invalid_request_error"),  # the model does not think
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "invalid_request_error"),
    ]
    for extra, kind in refusals:
        refused_body = httpx.post(server.url + "/v1/messages", json={**body, **extra}, headers={"x-api-key": key})
        assert refused_body.status_code in (400, 404) and refused_body.json()["type"] == "error"
        assert refused_body.json()["error"]["type"] == kind and refused_body.json()["error"]["message"]


# Both


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/responses", {"input": LONG_QUESTION, "max_output_tokens": 400}),
     ("/v1/messages", {"messages": [{"role": "user", "content": LONG_QUESTION}], "max_tokens": 400})],
)  # fmt: skip
def test_a_client_leaving_a_stream_frees_its_slot(server: Server, path: str, body: dict[str, Any]) -> None:
    key_id, key = make_key_record(server.data_dir, f"leaver{path.replace('/', '-')}")
    request = {"model": MODEL, "stream": True, "temperature": 0, **body}
    with httpx.stream("POST", server.url + path, json=request, headers={"x-api-key": key}, timeout=60) as answer:
        assert answer.status_code == 200
        next(answer.iter_lines())  # the stream has started: the client leaves
    assert wait_for(lambda: [row["outcome"] for row in ledger_rows(server, key_id, path)] == ["client_closed"], 10)


# Reasoning


def greedy(**fields: Any) -> Any:
    return {"model": THINK, "messages": [{"role": "user", "content": LONG_QUESTION}], "max_tokens": 40,
            "temperature": 0, **fields}  # fmt: skip


def test_a_thinking_template_is_detected_and_reasoning_passed_through(sdk: openai.OpenAI) -> None:
    # Greedy, and a question the model thinks about at length: a thinking budget cuts it short.
    ask = [{"role": "user", "content": LONG_QUESTION}]
    thought = sdk.chat.completions.create(model=THINK, messages=ask, max_tokens=40, temperature=0)  # type: ignore[arg-type]
    reasoning = getattr(thought.choices[0].message, "reasoning_content", None)
    assert isinstance(reasoning, str) and reasoning.strip()
    plain = sdk.chat.completions.create(**greedy(reasoning_effort="none"))
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None and plain.choices[0].message.content
    # A budget of a quarter of max_tokens ends the thinking early: the answer follows.
    budgeted = sdk.chat.completions.create(**greedy(reasoning_effort="low"))
    assert budgeted.choices[0].message.content and getattr(budgeted.choices[0].message, "reasoning_content", "")
    stream = sdk.chat.completions.create(model=THINK, messages=ask, max_tokens=20, stream=True)  # type: ignore[arg-type]
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert any(getattr(delta, "reasoning_content", None) for delta in deltas)


def test_reasoning_in_responses_and_in_messages(sdk: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    response = sdk.responses.create(
        model=THINK, input=LONG_QUESTION, max_output_tokens=40, temperature=0, reasoning={"effort": "low"}
    )
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and "message" in kinds
    with sdk.responses.stream(model=THINK, input="What is 2 + 2?", max_output_tokens=20) as stream:
        assert "response.reasoning_text.delta" in [event.type for event in stream]
    message = claude.messages.create(
        model=THINK, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 10}, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": LONG_QUESTION}],
    )  # fmt: skip
    assert [block.type for block in message.content][:2] == ["thinking", "text"]
    off = claude.messages.create(
        model=THINK, max_tokens=20, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}]
    )
    assert [block.type for block in off.content] == ["text"]
