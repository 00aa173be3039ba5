"""Tool calling and structured outputs, as payloads and as answers read back (engine/tools.py, shapes.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmserver.engine import shapes, translate
from llmserver.engine.tools import ToolPlan, check_request
from llmserver.errors import InvalidRequest
from llmserver.schemas.openai import ChatMessage, ChatRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields})


def conversation() -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="call_1", content="Sunny, 21 C"),
    ]


def test_prompted_payload_describes_the_tools_and_constrains_the_answer() -> None:
    plan = ToolPlan.of(request(tools=[WEATHER, TIME]), native=False)
    payload = plan.payload(conversation())
    system, _, assistant, result = payload["messages"]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\nYou can call the tools")
    assert '"get_weather"' in system["content"] and '{"response":' in system["content"]
    assert json.loads(assistant["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    # The result in words, naming its tool: an answer copies JSON it is shown (bench/tool_calls.py, leaks).
    assert result == {"role": "user", "content": "Result of get_weather: Sunny, 21 C"}
    schema = payload["response_format"]["json_schema"]["schema"]
    calls, answer = schema["anyOf"]
    names = [item["properties"]["name"]["const"] for item in calls["properties"]["tool_calls"]["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"] and answer["required"] == ["response"]
    assert "tools" not in payload


def test_required_named_and_serial_choices_narrow_the_schema() -> None:
    required = ToolPlan.of(request(tools=[WEATHER, TIME], tool_choice="required"), native=False)
    assert required._answer_schema()["required"] == ["tool_calls"]
    named = ToolPlan.of(
        request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), native=False
    )
    assert [tool.function.name for tool in named.tools] == ["get_time"] and named.choice == "required"
    serial = ToolPlan.of(request(tools=[WEATHER], parallel_tool_calls=False), native=False)
    assert serial._answer_schema()["anyOf"][0]["properties"]["tool_calls"]["maxItems"] == 1
    none = ToolPlan.of(request(tools=[WEATHER], tool_choice="none"), native=False)
    assert not none.prompted and "response_format" not in none.payload(conversation())


def test_native_payload_passes_tools_and_history_to_llama_server() -> None:
    plan = ToolPlan.of(
        request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        native=True,
    )
    payload = plan.payload(conversation())
    assert [tool["function"]["name"] for tool in payload["tools"]] == ["get_weather"]
    assert payload["tool_choice"] == "required" and payload["parallel_tool_calls"] is True
    assert payload["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    assert payload["messages"][3] == {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"}


def test_prompted_answers_read_back_as_calls_or_content() -> None:
    plan = ToolPlan.of(request(tools=[WEATHER]), native=False)
    content, calls = plan.read('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', "stop")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert plan.read('{"response": "It is sunny."}', "stop") == ("It is sunny.", [])


@pytest.mark.parametrize(
    ("cut", "content", "names"),
    [
        ('{"tool_calls": [{"name": "get_we', None, []),
        ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_w', None,
         ["get_weather"]),
        ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", '
         '"arguments": {"city": "Rome"}}', None, ["get_weather", "get_weather"]),
        ('{"response": "It is sun', "It is sun", []),
        ('{"response": "a \\u00e9 b \\u00', "a \u00e9 b ", []),
        ('{"response": {"name": "Ada", "ag', '{"name": "Ada", "ag', []),
        ('{"respo', None, []),
        ('{\n  "tool_calls": [\n    {\n      "name": "get_weather",\n      "arguments": {\n        "city": "Paris"\n'
         '      }\n    },\n    {\n      "name": "get_weather",\n      "arguments": {\n        "city": "', None,
         ["get_weather"]),
    ],
)  # fmt: skip
def test_a_prompted_answer_cut_short_keeps_its_complete_calls_and_never_our_json(
    cut: str, content: str | None, names: list[str]
) -> None:
    plan = ToolPlan.of(request(tools=[WEATHER]), native=False)
    got_content, calls = plan.read(cut, "length")
    assert got_content == content and [call["function"]["name"] for call in calls] == names


def test_a_cut_call_answer_says_length_with_the_complete_calls() -> None:
    plan = ToolPlan.of(request(tools=[WEATHER]), native=False)
    cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"na'
    body = {"choices": [{"message": {"content": cut}, "finish_reason": "length"}], "usage": {}}
    choice = shapes.chat(body, "m", plan, translate.usage(body))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 1
    stream = shapes.ChatStream(ToolPlan.of(request(tools=[WEATHER], stream=True), native=False))
    (call,) = stream.pieces({"delta": {"content": cut}})  # sent once whole, before the answer ends
    assert call["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    (last,) = stream.pieces({"delta": {}, "finish_reason": "length"})
    assert last["finish_reason"] == "length"


def test_reasoning_is_passed_through_as_reasoning_content() -> None:
    plan = ToolPlan.of(request(), native=False)
    body = {"choices": [{"message": {"content": "4", "reasoning_content": "2 and 2"}, "finish_reason": "stop"}]}
    answer = shapes.chat(body, "m", plan, translate.usage(body))
    assert answer["choices"][0]["message"]["reasoning_content"] == "2 and 2"
    stream = shapes.ChatStream(plan)
    (piece,) = stream.pieces({"delta": {"reasoning_content": "2 and"}})
    assert piece["delta"] == {"reasoning_content": "2 and"}


def test_a_non_streamed_prompted_call_has_the_openai_shape() -> None:
    plan = ToolPlan.of(request(tools=[WEATHER]), native=False)
    body = {
        "choices": [{"message": {"content": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 5},
    }  # fmt: skip
    choice = shapes.chat(body, "m", plan, translate.usage(body))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_prompted_stream_holds_the_json_back_and_sends_tool_call_deltas() -> None:
    stream = shapes.ChatStream(ToolPlan.of(request(tools=[WEATHER], stream=True), native=False))
    answer = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    pieces = stream.pieces({"delta": {"role": "assistant", "content": None}})
    assert pieces == [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]
    sent = [
        piece for at in range(0, len(answer), 7) for piece in stream.pieces({"delta": {"content": answer[at : at + 7]}})
    ]
    (calls,) = sent  # the call, once whole, and nothing of our JSON
    (last,) = stream.pieces({"delta": {}, "finish_reason": "stop"})
    assert last["finish_reason"] == "tool_calls"
    (call,) = calls["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_prompted_direct_answer_streams_its_text_as_it_is_decoded() -> None:
    """Issue 55: with tools offered, the text came in one piece at the end (Codex's idle timeout fired)."""
    stream = shapes.ChatStream(ToolPlan.of(request(tools=[WEATHER], stream=True), native=False))
    answer = json.dumps({"response": 'Oslo: 21 °C, "sunny" \\ 😀 and\nmore text to come'}, ensure_ascii=True)
    sent = [
        piece for at in range(0, len(answer), 3) for piece in stream.pieces({"delta": {"content": answer[at : at + 3]}})
    ]
    *rest, last = stream.pieces({"delta": {}, "finish_reason": "stop"})
    text = "".join(piece["delta"].get("content", "") for piece in [*sent, *rest])
    assert text == json.loads(answer)["response"] and last["finish_reason"] == "stop"
    assert len(sent) > 10  # piece by piece, not at the end
    assert ToolPlan.of(request(tools=[WEATHER]), native=False).read(answer, "stop")[0] == text  # as unstreamed


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
OTHER = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def test_a_prompted_answer_ends_at_its_first_repeated_call() -> None:
    """Issue 55: the embedded model repeats one call until max_tokens (the Agents SDK's handoff failed)."""
    plan = ToolPlan.of(request(tools=[WEATHER], tool_choice="required"), native=False)
    assert plan._answer_schema()["properties"]["tool_calls"]["maxItems"] == 8  # bounded in the grammar too
    content, calls = plan.read(f'{{"tool_calls": [{CALL}, {OTHER}, {CALL}, {OTHER}]}}', "stop")
    assert content is None and [json.loads(call["function"]["arguments"])["city"] for call in calls] == ["Oslo", "Rome"]
    _, cut_calls = plan.read(f'{{"tool_calls": [{CALL}, {CALL}, {{"name": "get_w', "length")
    assert len(cut_calls) == 1


def test_a_prompted_stream_stops_at_a_repeated_call_without_waiting_for_the_rest() -> None:
    stream = shapes.ChatStream(ToolPlan.of(request(tools=[WEATHER], stream=True), native=False))
    sent = [
        piece
        for text in ('{"tool_calls": [', CALL, ", ", OTHER, ", ")
        for piece in stream.pieces({"delta": {"content": text}})
    ]
    assert [piece["delta"]["tool_calls"][0]["index"] for piece in sent] == [0, 1] and not stream.stopped
    (last,) = stream.pieces({"delta": {"content": CALL}})
    assert stream.stopped and last["finish_reason"] == "tool_calls"
    assert stream.pieces({"delta": {"content": ", " + OTHER}}) == []  # what llama-server sends after is dropped


def test_structured_answers_lose_a_markdown_fence() -> None:
    assert shapes.unfenced('```json\n{"a": 1}\n```') == '{"a": 1}'
    assert shapes.unfenced('{"a": 1}') == '{"a": 1}'


@pytest.mark.parametrize(
    "fields",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"properties": {"code": {"pattern": "ab"}}}},
            }
        },
    ],
)
def test_unanchored_patterns_are_refused_naming_the_place(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_request(request(**fields))
    assert caught.value.param == next(iter(fields))
    assert "not anchored" in caught.value.message and "#/" in caught.value.message


def test_a_tools_unanchored_pattern_is_left_unenforced_and_a_refusal_names_the_tool() -> None:
    unanchored = {"properties": {"a": {"pattern": "^a"}}}
    hangs = {"properties": {"a": {"pattern": "^((a{0,99}){0,99}){0,99}$"}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
             for name, schema in (("f", unanchored), ("g", unanchored), ("read_file", hangs))]  # fmt: skip
    check_request(request(tools=tools[:2]))
    with pytest.raises(InvalidRequest) as caught:
        check_request(request(tools=tools))
    assert caught.value.param == "tools.2"
    assert caught.value.message.startswith("tools.2 (read_file): the pattern")


def test_logprobs_take_openai_shapes() -> None:
    raw = {"content": [{"id": 5, "token": "Hi", "bytes": [72, 105], "logprob": -0.5,
                        "top_logprobs": [{"id": 5, "token": "Hi", "bytes": [72, 105], "logprob": -0.5},
                                         {"id": 6, "token": "Yo", "bytes": [89, 111], "logprob": -1.5}]}]}  # fmt: skip
    chat = translate.chat_logprobs(raw, 2)
    hi, yo = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}
    assert chat == {"content": [{**hi, "top_logprobs": [hi, yo]}], "refusal": None}
    assert translate.chat_logprobs(raw, 0) == {"content": [{**hi, "top_logprobs": []}], "refusal": None}
    legacy = translate.LegacyLogprobs(1, "Say")
    assert legacy(raw) == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"Hi": -0.5}],
        "text_offset": [3],
    }
    assert legacy(raw)["text_offset"] == [5]  # carried across a stream's events
