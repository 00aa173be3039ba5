"""The Responses and Messages APIs read as chat requests, and chat answers (and streams) shaped back;
the reasoning fields. Against the real server and SDKs: tests/e2e/test_client_apis.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmserver.api.translated import _rename
from llmserver.dialects import anthropic, responses
from llmserver.engine import reasoning, shapes
from llmserver.errors import InvalidRequest
from llmserver.llama.template import Template
from llmserver.schemas.anthropic import MessagesRequest
from llmserver.schemas.openai import ChatRequest
from llmserver.schemas.responses import PARAMS, ResponsesRequest

THINKS = Template(thinks=True)


@pytest.mark.parametrize(
    ("effort", "budget", "expected"),
    [
        (None, None, {}),
        ("none", None, {"chat_template_kwargs": {"enable_thinking": False}}),
        ("minimal", None, {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": 50}),
        ("low", None, {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": 100}),
        ("medium", None, {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": 200}),
        ("high", None, {"chat_template_kwargs": {"enable_thinking": True}}),
        ("high", 64, {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": 64}),
        ("high", 4000, {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": 400}),
    ],
)
def test_an_effort_is_thinking_on_or_off_and_a_share_of_max_tokens(
    effort: str | None, budget: int | None, expected: dict[str, Any]
) -> None:
    assert reasoning.fields(effort, budget, 400, THINKS, "m") == expected


def test_a_template_that_does_not_think_refuses_an_effort_but_none() -> None:
    plain = Template()
    assert reasoning.fields("none", None, 400, plain, "m") == {}
    with pytest.raises(InvalidRequest) as refused:
        reasoning.fields("low", None, 400, plain, "m")
    assert refused.value.param == "reasoning_effort"
    with_levels = Template(thinks=True, effort=True)
    assert reasoning.fields("low", None, 400, with_levels, "m")["reasoning_effort"] == "low"


def chat_of_response(**fields: Any) -> tuple[ChatRequest, list[str]]:
    chat = ResponsesRequest.model_validate(fields).chat()
    return ChatRequest.model_validate(chat.body), chat.origins


def test_a_responses_input_becomes_the_chat_conversation() -> None:
    chat, origins = chat_of_response(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [
                {"type": "input_text", "text": "Weather in Paris and Rome?"},
                {"type": "file", "file": {"filename": "a.txt", "data": "data:text/plain;base64,SGk="}},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": "25 C"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Warm."}]},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"},
        max_output_tokens=50,
    )  # fmt: skip
    roles = [message.role for message in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert origins == ["instructions", "input.0", "input.2", "input.4", "input.5", "input.6"]
    parts = chat.messages[1].content
    assert isinstance(parts, list) and [part.type for part in parts] == ["text", "file"]  # our own parts too
    calls = chat.messages[2].tool_calls or []
    assert [call.id for call in calls] == ["c1", "c2"] and chat.messages[2].reasoning_content == "Two."
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert (chat.max_tokens, chat.reasoning_effort) == (50, "low")
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools.0.type"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "mcp"}]}]},
            "tools.0.tools.0.type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": []}, "input"),
    ],
)
def test_a_responses_input_it_cannot_read_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ResponsesRequest.model_validate(fields).chat()
    assert refused.value.param == param


def test_chat_errors_are_renamed_to_the_clients_parameters() -> None:
    origins = ["instructions", "input.0", "input.2"]
    assert _rename("messages.2.content.1", origins, PARAMS) == "input.2.content.1"
    assert _rename("messages.7", origins, PARAMS) == "input"
    assert _rename("max_tokens", origins, PARAMS) == "max_output_tokens"
    assert _rename("response_format.json_schema", origins, PARAMS) == "text.format.json_schema"
    assert _rename("temperature", origins, PARAMS) == "temperature"
    # raised while translating: already the client's own place, kept whole (issue 55)
    assert _rename("messages.3.content.0.content.1.type", [], {}) == "messages.3.content.0.content.1.type"


def test_anthropic_messages_become_the_chat_conversation() -> None:
    request = MessagesRequest.model_validate({
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Read this."},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Hello"}},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And now?"},
            ]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 30},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"},
    })  # fmt: skip
    translated = request.chat()
    chat, origins, budget = ChatRequest.model_validate(translated.body), translated.origins, translated.budget
    assert [message.role for message in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert origins == ["system", "messages.0", "messages.1", "messages.2", "messages.2"]
    parts = chat.messages[1].content
    assert isinstance(parts, list) and [part.type for part in parts] == ["text", "file", "image_url"]
    assistant = chat.messages[2]
    assert assistant.reasoning_content == "Look it up." and assistant.tool_calls is not None
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop, chat.user) == ("required", False, ["END"], "u1")
    assert (chat.reasoning_effort, budget) == ("high", 30)


def test_anthropic_output_config_is_an_effort_and_a_schema() -> None:
    request = MessagesRequest.model_validate({
        "max_tokens": 100, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}},
    })  # fmt: skip
    translated = request.chat()
    chat, budget, names = ChatRequest.model_validate(translated.body), translated.budget, translated.names
    assert (chat.reasoning_effort, budget, names["reasoning_effort"]) == ("xhigh", None, "output_config.effort")
    assert chat.response_format is not None and chat.response_format.type == "json_schema"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "x"}], "messages.0.role"),
        # a block deep in a tool result keeps its whole place (issue 55: it was named `messages`)
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "a"}, {"type": "search_result"}]}]}], "messages.0.content.0.content.1.type"),
        ([{"role": "user", "content": [{"type": "search_result"}]}], "messages.0.content.0.type"),
        ([{"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": "http://x"}}]}],
         "messages.0.content.0.source"),
        ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
         "messages.0.content.0.input"),
    ],
)  # fmt: skip
def test_anthropic_blocks_it_cannot_read_are_refused_by_name(messages: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        MessagesRequest.model_validate({"max_tokens": 5, "messages": messages}).chat()
    assert refused.value.param == param


def test_an_image_in_a_tool_result_follows_it_in_the_users_turn() -> None:
    """Claude Code's Read of a PNG answers with an image block inside the tool_result."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Look at a.png."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "a.png:"}, image]}]},
    ]})  # fmt: skip
    *_, result, shown = request.chat().body["messages"]
    assert result == {"role": "tool", "tool_call_id": "t1", "content": "a.png:"}
    assert shown["role"] == "user" and [part["type"] for part in shown["content"]] == ["text", "image_url"]
    assert shown["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw0KGgo="


def test_anthropic_system_messages_among_the_turns() -> None:
    """Claude Code sends `role: system` inside messages (its agent and skill lists, background notices):
    before any turn they join the system prompt; later they are a note in the user's turn, so that the
    template gets one system message, first, and the prompt before them is unchanged (cached)."""
    request = MessagesRequest.model_validate({"max_tokens": 5, "system": "S", "messages": [
        {"role": "system", "content": "Agents: a, b."},
        {"role": "user", "content": "Run ls."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]},
        {"role": "system", "content": [{"type": "text", "text": "A task finished."}]},
        {"role": "assistant", "content": "Done."},
        {"role": "system", "content": "Remember b."},
    ]})  # fmt: skip
    chat = request.chat()
    roles = [m["role"] for m in chat.body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "user"]
    assert chat.body["messages"][0]["content"] == "S\n\nAgents: a, b."
    assert chat.body["messages"][4]["content"] == [{"type": "text", "text": "<system>\nA task finished.\n</system>"}]
    assert chat.origins[4] == "messages.4" and chat.origins[6] == "messages.6"
    ChatRequest.model_validate(chat.body)


def test_anthropic_fields_that_change_no_answer_are_accepted() -> None:
    """Claude Code's and the API's fields (issue 55): context management, every tool field, and
    thinking or an effort it may skip on a model that does not think; `thinking: enabled` still demands."""
    request = MessagesRequest.model_validate({
        "max_tokens": 32000, "messages": [{"role": "user", "content": "x"}], "context_management": {"edits": []},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True, "eager_input_streaming": True,
                   "input_examples": [{}], "defer_loading": False, "allowed_callers": ["direct"]}],
    })  # fmt: skip
    chat = request.chat()
    assert chat.optional_thinking and chat.body["reasoning_effort"] == "medium"
    assert reasoning.fields("medium", None, 100, Template(), "m", optional=True) == {}
    demanded = MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                               "thinking": {"type": "enabled", "budget_tokens": 2}}).chat()  # fmt: skip
    assert not demanded.optional_thinking
    with pytest.raises(InvalidRequest):
        reasoning.fields("high", 2, 5, Template(), "m", optional=demanded.optional_thinking)


def test_codex_default_tools_a_namespace_served_flat_and_web_search_ignored() -> None:
    """Codex sends `type: "namespace"` (its sub-agent tools) and `web_search` with every request."""
    close = {"type": "function", "name": "close_agent", "parameters": {"type": "object"}, "defer_loading": True}
    request = ResponsesRequest.model_validate({
        "input": [{"type": "function_call", "call_id": "c0", "name": "close_agent", "namespace": "agents",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c0", "output": "closed"}],
        "tools": [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                  {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [close]},
                  {"type": "web_search", "external_web_access": False}],
    })  # fmt: skip
    chat = request.chat().body
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["exec_command", "agents__close_agent"]
    assert chat["messages"][0]["tool_calls"][0]["function"]["name"] == "agents__close_agent"
    answer = {**ANSWER, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "agents__close_agent", "arguments": "{}"}}],
    }}]}  # fmt: skip
    call = responses.response(answer, request)["output"][0]
    assert (call["type"], call["namespace"], call["name"]) == ("function_call", "agents", "close_agent")
    streamed = spoken(responses.Voice(request, "m"),
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "function": {"name": "agents__close_agent", "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    )  # fmt: skip
    added = next(event["item"] for event in streamed if event["type"] == "response.output_item.added")
    assert (added["namespace"], added["name"]) == ("agents", "close_agent")


def test_an_output_no_call_asked_for_is_a_note_naming_its_function() -> None:
    """Codex sends its goal's objective as a function_call_output with a name and no call_id."""
    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Hi"},
        {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "Count to 2."},
    ]})  # fmt: skip
    note = request.chat().body["messages"][-1]
    assert note["role"] == "user" and note["content"][0]["text"] == "Result of agent__goal_objective:"
    assert note["content"][1]["text"] == "Count to 2."


def test_codex_client_metadata_is_accepted() -> None:
    request = ResponsesRequest.model_validate({"input": "x", "client_metadata": {"originator": "codex_exec"}})
    assert "client_metadata" not in request.chat().body


ANSWER = {
    "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me look.", "reasoning_content": "Paris.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    }}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
              "prompt_tokens_details": {"cached_tokens": 4}},
}  # fmt: skip


def test_a_chat_answer_as_a_response_and_as_a_message() -> None:
    shaped = responses.response(ANSWER, ResponsesRequest.model_validate({"input": "x"}))
    assert [item["type"] for item in shaped["output"]] == ["reasoning", "message", "function_call"]
    assert shaped["status"] == "completed" and shaped["usage"]["input_tokens_details"] == {"cached_tokens": 4}
    assert shaped["output"][2]["call_id"] == "c1"
    message = anthropic.message(ANSWER)
    assert [block["type"] for block in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["stop_reason"] == "tool_use" and message["content"][2]["input"] == {"city": "Paris"}
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == 10


def spoken(
    voice: shapes.Voice,
    *chunks: dict[str, Any],
    usage: dict[str, Any] | None = None,
    reading: int = 0,
    failure: dict[str, Any] | None = None,
    texts: tuple[bytes, ...] = (),
) -> list[dict[str, Any]]:
    """What `voice` writes for a stream: its opening, `reading` keepalives, the chunks' choices as the
    relay hands them over (then `texts`, tokens relayed unparsed), a failure or its end; parsed."""
    out = [voice.opening(), *(voice.reading() for _ in range(reading))]
    out += [voice.pieces(chunk["choices"]) for chunk in chunks]
    out += [voice.text(shapes.CHAT_TOKEN, text) for text in texts]
    if failure is not None:
        out.append(voice.error(failure))
    out.append(voice.closing(usage))
    raw = b"".join(out)
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


STREAMED = (
    {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "Hm"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
)
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_chat_stream_as_responses_events() -> None:
    got = spoken(responses.Voice(ResponsesRequest.model_validate({"input": "x"}), "m"), *STREAMED, usage=USAGE)
    assert [event["type"] for event in got] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [event["sequence_number"] for event in got] == list(range(1, len(got) + 1))
    final = got[-1]["response"]
    assert final["output"][1]["content"][0]["text"] == "Hi there" and final["usage"]["output_tokens"] == 4


def test_a_chat_stream_as_anthropic_events() -> None:
    got = spoken(anthropic.Voice("m"), *STREAMED, usage=USAGE)
    assert [event["type"] for event in got] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert got[-2]["delta"]["stop_reason"] == "max_tokens" and got[-2]["usage"]["output_tokens"] == 4


def test_a_prompt_still_being_read_keeps_each_apis_stream_alive() -> None:
    """Issue 55: Codex gives up on a stream idle for 300 s, and an agent's prompt can take longer to read
    on a CPU: the relay's keepalive comment becomes an event each client counts."""

    voice = responses.Voice(ResponsesRequest.model_validate({"input": "x"}), "m")
    kinds = [event["type"] for event in spoken(voice, STREAMED[0], reading=2)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.in_progress", "response.in_progress"]
    kinds = [event["type"] for event in spoken(anthropic.Voice("m"), STREAMED[0], reading=2)]
    assert kinds[:4] == ["message_start", "ping", "ping", "ping"]


def test_a_token_relayed_unparsed_is_the_same_event_as_a_parsed_one() -> None:
    """The relay hands most tokens over as llama-server's JSON string (`Voice.text`): each API's events are
    the ones the same text as a parsed piece makes."""
    texts = (b'"Hi"', b'" th\\u00e9re \\"q\\""')
    parsed = [{"choices": [{"index": 0, "delta": {"content": json.loads(text)}}]} for text in texts]
    request = ResponsesRequest.model_validate({"input": "x"})
    for voice in (lambda: responses.Voice(request, "m"), lambda: anthropic.Voice("m")):
        fast, slow = spoken(voice(), texts=texts, usage=USAGE), spoken(voice(), *parsed, usage=USAGE)
        for event in (*fast, *slow):  # ids and times differ from one stream to the next
            event.pop("sequence_number", None)
            (event.get("response") or event.get("message") or {}).clear()
            (event.get("item") or {}).pop("id", None)
            event.pop("item_id", None)
        assert fast == slow
    deltas = spoken(anthropic.Voice("m"), texts=texts)
    assert "".join(e["delta"]["text"] for e in deltas if e["type"] == "content_block_delta") == 'Hi th\u00e9re "q"'


def test_a_failure_mid_stream_is_each_apis_error_event() -> None:
    failure = {"error": {"message": "The stream failed.", "type": "server_error", "code": 500}}
    got = spoken(responses.Voice(ResponsesRequest.model_validate({"input": "x"}), "m"), STREAMED[2], failure=failure)
    assert [event["type"] for event in got][-2:] == ["error", "response.failed"]
    got = spoken(anthropic.Voice("m"), STREAMED[2], failure=failure)
    assert got[-1] == {"type": "error", "error": {"type": "api_error", "message": "The stream failed."}}


def test_a_counted_prompt_too_long_is_anthropics_own_words() -> None:
    from llmserver.errors import ContextLengthExceeded

    error = ContextLengthExceeded("The prompt is 900 tokens, ...", param="messages", tokens=900, context=512)
    assert error.body_for("/v1/messages")["error"] == {
        "type": "invalid_request_error", "message": "prompt is too long: 900 tokens > 512 maximum"
    }  # fmt: skip
    assert error.body_for("/api/generate") == error.body()  # the seed's envelope on the native API
    # OpenAI's clients (Codex) read the overflow in `code`, as OpenAI answers it.
    for path in ("/v1/chat/completions", "/v1/responses"):
        assert error.body_for(path)["error"] == {**error.body()["error"], "code": "context_length_exceeded"}
